"""The collectives a rank issues, by kind, with their sizes, dtypes and groups.

`CollectiveCounter` hears every c10d op (``torch.ops.c10d.*``: what ``dist.all_gather_into_tensor``
and friends dispatch to, on any backend) and every functional collective
(``torch.ops._c10d_functional.*``: what DTensor and compiled code use), whatever Python API or
engine issued them, through those ops' own kernels (`collective_ops`: no other op is slowed). A
wrapper subclass (DTensor) dispatches first, so the collectives it issues inside come as plain
tensors. Where a dispatch mode that may answer a collective itself is already active (simulate's
silent fake world), the counter is a ``TorchDispatchMode`` on top of it instead, and hears the same calls.

The *volume* ``V`` of one call is its full buffer: the gathered output of an all-gather, the
unreduced input of a reduce-scatter, the tensor of an all-reduce (the largest operand group). The
bytes one rank sends for it in a ring over a group of ``n`` ranks (``sent``):

    all_gather, reduce_scatter:  V * (n - 1) / n
    all_reduce:                  2 * V * (n - 1) / n      (a reduce-scatter, then an all-gather)
    broadcast, all_to_all:       V * (n - 1) / n

The group of a call is read from its process-group operand (c10d ops) or group name (functional
ops), as its global ranks, so a collective in the wrong mesh dimension shows.

On the threaded backend (harness thread mode) the process group is Python: its collectives pass no
dispatcher op, so the counter is no dispatch mode there; it taps the group's methods instead
(`shardcheck.harness.threads.tap_collectives`), and sees the same kinds, volumes and dtypes, the group as its
size. (Four rank threads' dispatch modes in one process once ended in a segmentation fault inside
torch's dispatch; the tap also avoids that.)
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass_type
from torch.utils._pytree import tree_leaves

from shardcheck.conformance.measure.collective_ops import NAMESPACES, listening, modes_may_answer_collectives

KINDS = {  # op name prefix (overload stripped) -> kind; first match wins
    "allgather": "all_gather", "_allgather": "all_gather", "all_gather": "all_gather",
    "reduce_scatter": "reduce_scatter", "_reduce_scatter": "reduce_scatter",
    "allreduce": "all_reduce", "all_reduce": "all_reduce",
    "broadcast": "broadcast", "all_to_all": "all_to_all", "alltoall": "all_to_all",
}
IGNORED = ("wait_tensor", "barrier", "monitored_barrier", "_wrap_tensor_autograd")
RING_FACTOR = {"all_reduce": 2.0}  # bytes sent per rank = factor * V * (n - 1) / n; 1 for the others


def kind_of(op_name: str) -> str:
    for prefix, kind in KINDS.items():
        if op_name.startswith(prefix):
            return kind
    return op_name


@dataclass(frozen=True)
class Collective:
    """One collective call seen on this rank."""

    kind: str
    op: str
    volume: int                  # bytes of the full buffer (see the module doc)
    dtype: torch.dtype | None    # of the largest tensor operand
    ranks: tuple | None          # the global ranks of its group (None: not found)

    @property
    def reduces_floats(self) -> bool:
        """A reduction (reduce-scatter, all-reduce) of floating-point values: gradients, norms."""
        return self.kind in ("reduce_scatter", "all_reduce") and self.dtype is not None and self.dtype.is_floating_point

    @property
    def sent(self) -> float:
        """Bytes this rank sends for it in a ring (the module doc's formula)."""
        n = len(self.ranks) if self.ranks else 1
        return RING_FACTOR.get(self.kind, 1.0) * self.volume * (n - 1) / n


def _nbytes(tree) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(tree) if isinstance(t, torch.Tensor))


def _dtype(args, out) -> torch.dtype | None:
    tensors = [t for t in tree_leaves((args, out)) if isinstance(t, torch.Tensor)]
    return max(tensors, key=torch.Tensor.numel).dtype if tensors else None


def _ranks_of(func, args, cache: dict) -> tuple | None:
    """The global ranks of the group a collective runs in."""
    from torch._C._distributed_c10d import ProcessGroup

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
                cache[key] = tuple(sorted(dist.get_process_group_ranks(pg)))
            except (ValueError, RuntimeError, KeyError):  # not registered with the default world
                cache[key] = tuple(range(pg.size()))
        return cache[key]
    return None


class CollectiveCounter(TorchDispatchMode):
    """``with CollectiveCounter() as c: step()``; then ``c.calls`` (every `Collective`) and
    ``c.by_kind()`` -> {kind: {count, bytes, groups}}."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Collective] = []
        self._groups: dict = {}
        self._tap = None  # on the threaded backend: the tap on its group's methods, while active
        self._listening = None  # else, with no dispatch mode below: the collective ops' kernels

    def __enter__(self):
        if dist.is_initialized() and dist.get_backend() == "threaded":
            from shardcheck.harness.threads import tap_collectives

            self._tap = tap_collectives(self._seen_on_threaded_group)
            self._tap.__enter__()
            return self
        if not modes_may_answer_collectives():  # heard by the collective ops' own kernels, no other op slowed
            self._listening = listening(self._seen)
            self._listening.__enter__()
            return self
        return super().__enter__()  # a mode above the others: one below may answer a collective itself

    def __exit__(self, *exc):
        if self._tap is not None:
            tap, self._tap = self._tap, None
            return tap.__exit__(*exc)
        if self._listening is not None:
            heard, self._listening = self._listening, None
            return heard.__exit__(*exc)
        return super().__exit__(*exc)

    def _seen_on_threaded_group(self, method: str, args, backend) -> None:
        size = max(_nbytes(a) for a in args) if args else 0
        self.calls.append(Collective(kind_of(method), method, size, _dtype(args, None),
                                     tuple(range(backend.size()))))

    def _seen(self, func, args, out) -> None:
        name = func._schema.name.split("::")[-1]
        if name not in IGNORED:
            size = max([_nbytes(a) for a in args] + [_nbytes(out)])
            self.calls.append(Collective(kind_of(name), name, size, _dtype(args, out),
                                         _ranks_of(func, args, self._groups)))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented  # a wrapper subclass dispatches first; its collectives come back here
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace in NAMESPACES:
            self._seen(func, args, out)
        return out

    def by_kind(self, describe=lambda ranks: ",".join(map(str, ranks))) -> dict[str, dict]:
        """{kind: {"count", "bytes" (volume), "groups" (each spelled by `describe(ranks)`)}}."""
        table: dict[str, dict] = defaultdict(lambda: {"count": 0, "bytes": 0, "groups": []})
        for c in self.calls:
            table[c.kind]["count"] += 1
            table[c.kind]["bytes"] += c.volume
            group = None if c.ranks is None else describe(c.ranks)
            if group is not None and group not in table[c.kind]["groups"]:
                table[c.kind]["groups"].append(group)
        return {k: dict(v, groups=sorted(v["groups"])) for k, v in sorted(table.items())}
