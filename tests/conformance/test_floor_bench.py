"""shardcheck.conformance.floor_bench: a cell's collectives are written down as its ranks issued them,
and the replay issues exactly those (groups, kinds, counts) and nothing else."""

import json

from shardcheck.conformance import floor_replay
from shardcheck.harness import run
from shardcheck.harness.ledger import ranks_of

CELL = '''
import torch
import torch.distributed as dist
from shardcheck.harness import distributed

@distributed(world_size=4)
def test_cell(ctx):
    pair = dist.new_group([0, 1])
    t = torch.ones(3)
    dist.all_reduce(t)
    dist.all_reduce(t)
    dist.broadcast(t, src=0)
    if ctx.rank in (0, 1):
        out = torch.empty(6)
        dist.all_gather_into_tensor(out, t, group=pair)
'''


def _by_ranks(issued: dict) -> dict:
    """{rank: {group ranks: {kind: calls}}}: group names differ between two sessions, ranks do not."""
    return {int(rank): {ranks_of(group): kinds for group, kinds in groups.items()}
            for rank, groups in issued.items()}


def test_a_cells_collectives_are_recorded_and_replayed_exactly(pytester, monkeypatch):
    pytester.makepyfile(test_cell=CELL)
    record = pytester.path / "cells.jsonl"
    monkeypatch.setenv("SHARDCHECK_FLOOR_RECORD", str(record))
    result = pytester.runpytest_subprocess("--shardcheck-backend", "gloo", "-q", "-p", "no:cacheprovider",
                                           "-p", "shardcheck.conformance.floor_bench")
    result.assert_outcomes(passed=1)
    (cell,) = [json.loads(line) for line in record.read_text().splitlines()]
    assert cell["world_size"] == 4
    recorded = _by_ranks(cell["ranks"])
    world, pair = (0, 1, 2, 3), (0, 1)
    assert recorded[0] == {world: {"all_reduce": 2, "broadcast": 1}, pair: {"all_gather_into_tensor": 1}}
    assert recorded[3] == {world: {"all_reduce": 2, "broadcast": 1}}

    verdict = run(floor_replay.replay, 4, backend="gloo", cell=cell)
    assert verdict.outcome == "passed", verdict.message
    replayed = _by_ranks({r.rank: r.collectives["issued"] for r in verdict.results})
    assert replayed == recorded


def test_every_kind_the_ledger_names_replays_as_itself_or_an_all_reduce():
    issued = []
    for kind in ("all_gather_single", "reduce_scatter_single", "all_gather", "broadcast", "barrier",
                 "all_gather_object", "all_to_all"):
        verdict = run(floor_replay.replay, 2, backend="gloo",
                      cell={"ranks": {"0": {"0 (ranks 0, 1)": {kind: 1}}, "1": {"0 (ranks 0, 1)": {kind: 1}}}})
        assert verdict.outcome == "passed", verdict.message
        issued.append(verdict.results[0].collectives["issued"])
    names = [set(next(iter(i.values()))) for i in issued]
    # torch before 2.13 names the single-tensor pair all_gather_into_tensor / reduce_scatter_tensor (compat.py)
    assert names[0] in ({"all_gather_single"}, {"all_gather_into_tensor"})
    assert names[1] in ({"reduce_scatter_single"}, {"reduce_scatter_tensor"})
    assert names[2:6] == [{"all_gather"}, {"broadcast"}, {"barrier"}, {"all_gather_object"}]
    assert names[6] == {"all_reduce"}  # a kind the replay does not issue itself costs an all_reduce
