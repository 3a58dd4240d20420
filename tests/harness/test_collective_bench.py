"""The gloo collective micro-benchmark runs and reports what it measured (a few calls, world size 2)."""
from __future__ import annotations

from shardcheck.harness import collective_bench


def test_every_placement_reports_a_positive_price(capsys):
    result = collective_bench.main(["--calls", "20", "--world-sizes", "2"])
    assert [r["placement"] for r in result["rows"]] == list(collective_bench.PLACEMENTS)
    for row in result["rows"]:
        assert row["world_size"] == 2 and row["wall_ms"] > 0 and row["user_us"] + row["sys_us"] > 0, row
    assert '"benchmark": "gloo_all_reduce_10_floats"' in capsys.readouterr().out
