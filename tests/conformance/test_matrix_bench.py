"""shardcheck.conformance.matrix_bench's bookkeeping: what a sample of a rank counts as, and how the wall time is split."""

import json
import sys

from shardcheck.conformance import matrix_bench as bench
from shardcheck.harness import run


def full_grads(ctx):  # named like the adapter call a check makes: a comparison
    return bench.rank_category(sys._getframe())


def shard(ctx):
    return full_grads(ctx)  # the outermost named frame of the body decides: building


def body_category(ctx, outer):
    category = {"full_grads": full_grads, "shard": shard}[outer](ctx)
    ctx.record("category", category)


def test_a_sample_counts_as_the_outermost_named_call_of_the_check_body():
    for outer, expected in (("full_grads", "compare"), ("shard", "build")):
        verdict = run(body_category, 2, backend="threaded", outer=outer)
        assert verdict.outcome == "passed", verdict.message
        assert {value for r in verdict.results for _, value in r.records} == {expected}


def test_outside_a_test_body_a_sample_is_harness_time():
    assert bench.rank_category(sys._getframe()) == "harness"


def test_the_parents_wait_for_ranks_is_split_in_the_ranks_proportions(tmp_path):
    (tmp_path / "parent-1.json").write_text(json.dumps({"parent:ranks": 8.0, "parent:reporting": 1.0,
                                                        "parent:harness": 1.0}))
    (tmp_path / "rank-2.json").write_text(json.dumps({"rank:train": 3.0, "rank:compare": 1.0}))
    (tmp_path / "rank-3.json").write_text(json.dumps({"rank:train": 3.0, "rank:compare": 1.0}))
    out = bench.split(str(tmp_path), wall=12.0)
    assert out == {"harness": 3.0, "build": 0.0, "train": 6.0, "compare": 2.0, "other": 0.0, "reporting": 1.0}
