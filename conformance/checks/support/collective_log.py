"""Which collectives ran, of what kind and dtype: a TorchDispatchMode that notes every c10d and
functional collective issued while it is active (on this thread: the mode is thread-local; CPU
backward runs on the calling thread).

The smallest thing the dtype contract needs (checks/support/dtype_contract.py): kind, dtype and
element count per collective. `conformance/measure/traffic.py` (bytes and group sizes, on main)
records the same events; on merge this module should become a thin use of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")
KINDS = (("reduce_scatter", "reduce_scatter"), ("allreduce", "all_reduce"), ("all_reduce", "all_reduce"),
         ("allgather", "all_gather"), ("all_gather", "all_gather"), ("broadcast", "broadcast"))


@dataclass(frozen=True)
class Collective:
    kind: str  # reduce_scatter | all_reduce | all_gather | broadcast | the op's name
    dtype: torch.dtype
    numel: int  # elements of the first tensor argument

    @property
    def reduces_floats(self) -> bool:
        return self.kind in ("reduce_scatter", "all_reduce") and self.dtype.is_floating_point


def kind_of(func) -> str | None:
    """The collective kind of an op, or None for an op that is not a collective (wait_tensor too)."""
    if getattr(func, "namespace", None) not in NAMESPACES:
        return None
    name = func._schema.name.split("::")[-1]
    return next((kind for key, kind in KINDS if key in name), None)


class CollectiveLog(TorchDispatchMode):
    """`with CollectiveLog() as log:` ... `log.seen`: the collectives in the order they were issued."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[Collective] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = kind_of(func)
        if kind is not None:
            first = next((t for t in tree_leaves((args, kwargs or {})) if isinstance(t, torch.Tensor)), None)
            if first is not None:
                self.seen.append(Collective(kind, first.dtype, first.numel()))
        return func(*args, **(kwargs or {}))
