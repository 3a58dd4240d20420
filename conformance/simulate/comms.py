"""Count the collectives a training step issues, by kind, with their sizes.

A ``TorchDispatchMode`` sees every c10d op (``torch.ops.c10d.*``: what ``dist.all_gather_into_tensor``
and friends dispatch to) and every functional collective (``torch.ops._c10d_functional.*``: what
DTensor and compiled code use), whatever Python API issued them.  The size of one call is the
largest operand group -- the gathered output of an all-gather, the unreduced input of a
reduce-scatter, the tensor of an all-reduce -- i.e. the *full* (``group size x shard``) buffer.
The group of a call is read from its process-group operand (c10d ops) or group name (functional
ops) and recorded as its global ranks, so a collective in the wrong mesh dimension shows.
"""
from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

NAMESPACES = ("c10d", "_c10d_functional")
KINDS = {  # op name prefix (overload stripped) -> kind; first match wins
    "allgather": "all_gather", "_allgather": "all_gather", "all_gather": "all_gather",
    "reduce_scatter": "reduce_scatter", "_reduce_scatter": "reduce_scatter",
    "allreduce": "all_reduce", "all_reduce": "all_reduce",
    "broadcast": "broadcast", "all_to_all": "all_to_all", "alltoall": "all_to_all",
}
IGNORED = ("wait_tensor", "barrier", "monitored_barrier")


def kind_of(op_name: str) -> str:
    for prefix, kind in KINDS.items():
        if op_name.startswith(prefix):
            return kind
    return op_name


def _nbytes(tree) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(tree) if isinstance(t, torch.Tensor))


def _group_of(func, args, kwargs, cache: dict) -> str | None:
    """The ranks of the group a collective runs in, spelled by ``expected.describe_ranks``."""
    from torch._C._distributed_c10d import ProcessGroup

    from .expected import describe_ranks

    for arg, value in zip(func._schema.arguments, args):
        if isinstance(value, torch.ScriptObject) and "ProcessGroup" in str(value._type()):
            pg = ProcessGroup.unbox(value)
        elif arg.name == "group_name" or (isinstance(value, str) and arg.name == "group"):
            pg = dist.distributed_c10d._resolve_process_group(value)
        else:
            continue
        key = pg.group_name
        if key not in cache:
            try:
                cache[key] = describe_ranks(dist.get_process_group_ranks(pg))
            except (ValueError, RuntimeError, KeyError):  # not registered with the default world
                cache[key] = f"size {pg.size()}"
        return cache[key]
    return None


class CollectiveCounter(TorchDispatchMode):
    """``with CollectiveCounter() as c: step()`` then ``c.by_kind()`` -> {kind: {count, bytes, groups}}."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, str, int, str | None]] = []  # (kind, op, bytes, group)
        self._groups: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace in NAMESPACES:
            name = func._schema.name.split("::")[-1]
            if name not in IGNORED:
                size = max([_nbytes(a) for a in args] + [_nbytes(out)])
                self.calls.append((kind_of(name), name, size, _group_of(func, args, kwargs, self._groups)))
        return out

    def by_kind(self) -> dict[str, dict[str, int]]:
        table: dict[str, dict] = defaultdict(lambda: {"count": 0, "bytes": 0, "groups": []})
        for kind, _, size, group in self.calls:
            table[kind]["count"] += 1
            table[kind]["bytes"] += size
            if group is not None and group not in table[kind]["groups"]:
                table[kind]["groups"].append(group)
        return {k: dict(v, groups=sorted(v["groups"])) for k, v in sorted(table.items())}
