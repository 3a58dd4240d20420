"""The collectives of recorded cells, replayed alone: the test module `floor_bench` runs.

Each recorded cell (`SHARDCHECK_FLOOR_SPEC`: a JSON list of `{"nodeid", "world_size", "ranks"}`,
`ranks` being the harness's `COLLECTIVES_PROPERTY` of the cell: {rank: {group: {kind: calls}}}) is
one test here, on the same number of ranks. Each rank issues, group by group in one order every rank
shares, the calls of each kind the cell's rank issued, on a 16-float tensor: the same process groups,
kinds and counts, through the same harness, without a model or a check.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist

from shardcheck.compat import all_gather_single, reduce_scatter_single
from shardcheck.harness import distributed
from shardcheck.harness.ledger import ranks_of

SPEC_ENV = "SHARDCHECK_FLOOR_SPEC"
NUMEL = 16
_GROUPS: dict[tuple[int, ...], object] = {}  # this rank process's subgroups, by their ranks


def _spec() -> list:
    path = os.environ.get(SPEC_ENV)
    return json.load(open(path)) if path else []


def _cells(world_size: int) -> list:
    return [pytest.param(cell, id=cell["nodeid"].rsplit("::", 1)[-1])
            for cell in _spec() if cell["world_size"] == world_size]


def _group(ranks: tuple[int, ...]):
    """The world group, or a subgroup made once in this rank process (every rank makes every
    subgroup, in the same order: `dist.new_group` is collective over the world)."""
    if len(ranks) == dist.get_world_size():
        return dist.group.WORLD
    if ranks not in _GROUPS:
        _GROUPS[ranks] = dist.new_group(list(ranks))
    return _GROUPS[ranks]


def issue(kind: str, group) -> None:
    """One collective of `kind` on `group`, 16 floats a rank (an all_reduce for a kind not listed)."""
    size = dist.get_world_size(group)
    t = torch.ones(NUMEL)
    if kind in ("all_gather_single", "all_gather_into_tensor"):
        gather = getattr(dist, kind, all_gather_single)  # the name the cell called, where this torch has it
        gather(torch.empty(size * NUMEL), t, group=group)
    elif kind in ("reduce_scatter_single", "reduce_scatter_tensor"):
        scatter = getattr(dist, kind, reduce_scatter_single)
        scatter(torch.empty(NUMEL), torch.ones(size * NUMEL), group=group)
    elif kind == "all_gather":
        dist.all_gather([torch.empty(NUMEL) for _ in range(size)], t, group=group)
    elif kind == "broadcast":
        dist.broadcast(t, src=dist.get_global_rank(group, 0), group=group)
    elif kind == "all_gather_object":
        dist.all_gather_object([None] * size, 0, group=group)
    elif kind in ("barrier", "monitored_barrier"):
        dist.barrier(group=group)
    else:
        dist.all_reduce(t, group=group)


def replay(ctx, cell: dict) -> None:
    every = sorted({ranks_of(key) for per_rank in cell["ranks"].values() for key in per_rank})
    mine = {ranks_of(key): kinds for key, kinds in cell["ranks"].get(str(ctx.rank), {}).items()}
    for ranks in every:  # every rank walks every group in one order
        group = _group(ranks)
        for kind, calls in sorted(mine.get(ranks, {}).items()):
            for _ in range(calls):
                issue(kind, group)


def _test_at(world_size: int):
    """The replay test of the cells of one world size, named `test_replay_ws<N>` at module level (the
    harness finds a body by module and qualified name)."""

    @distributed(world_size=world_size)
    @pytest.mark.parametrize("cell", _cells(world_size))
    def test(ctx, cell):
        replay(ctx, cell)

    test.__name__ = test.__qualname__ = f"test_replay_ws{world_size}"
    return test


for _size in sorted({cell["world_size"] for cell in _spec()}):
    globals()[f"test_replay_ws{_size}"] = _test_at(_size)
