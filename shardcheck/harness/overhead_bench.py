"""Per-test overhead of each launch mode: `python -m shardcheck.harness.overhead_bench`.

The test body does one all_reduce, so what is measured is the harness: start-up (spawn), or
dispatch + the ranks' gate + isolation checks + result collection (pool, thread). The last column is
the part of a pool test that the isolation checks (shardcheck.harness.isolation) take, measured on a rank: what
each rank spends after its body in `settle` and `Settings.restore`. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist

from shardcheck.harness.runner import run, shutdown_pools


def one_all_reduce(ctx) -> None:
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == ctx.world_size


def time_isolation_checks(ctx, repeats: int = 200) -> None:
    """Record the seconds one rank spends per test in the isolation checks (settle, then restore)."""
    from shardcheck.harness.isolation import Baseline, Settings, settle
    from shardcheck.harness.task import RankResult

    before, settings = Baseline.take(), Settings.capture()
    start = time.perf_counter()
    for _ in range(repeats):
        settle(RankResult(ctx.rank, "passed"), before, None)
        settings.restore()
    ctx.record("isolation_s", (time.perf_counter() - start) / repeats)


def isolation_seconds(world_size: int) -> float:
    """The isolation checks' time per rank per test, the median over the pool's ranks."""
    verdict = run(time_isolation_checks, world_size)
    assert verdict.outcome == "passed", verdict.message
    (_, by_rank), = verdict.records()
    return sorted(v for values in by_rank.values() for v in values)[world_size // 2]


def per_test_seconds(world_size: int, mode: str, repeats: int) -> float:
    backend = "threaded" if mode == "thread" else "gloo"
    first = run(one_all_reduce, world_size, backend=backend, mode=mode)  # warm-up: pool start, imports
    assert first.outcome == "passed", first.message
    start = time.perf_counter()
    for _ in range(repeats):
        verdict = run(one_all_reduce, world_size, backend=backend, mode=mode)
        assert verdict.outcome == "passed", verdict.message
    return (time.perf_counter() - start) / repeats


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--world-sizes", default="2,4")
    parser.add_argument("--repeats", type=int, default=100, help="tests per pool/thread measurement")
    parser.add_argument("--spawn-repeats", type=int, default=3, help="tests per spawn measurement")
    args = parser.parse_args(argv)
    rows = []
    for ws in [int(s) for s in args.world_sizes.split(",")]:
        pool = per_test_seconds(ws, "pool", args.repeats)
        checks = isolation_seconds(ws)
        thread = per_test_seconds(ws, "thread", args.repeats)
        spawn = per_test_seconds(ws, "spawn", args.spawn_repeats)
        shutdown_pools()
        rows.append({"world_size": ws, "pool_ms": pool * 1e3, "thread_ms": thread * 1e3,
                     "spawn_ms": spawn * 1e3, "spawn_over_pool": spawn / pool,
                     "isolation_us_per_rank": checks * 1e6, "isolation_share": checks * ws / pool})
    print(f"{'world size':>10} {'pool ms':>9} {'thread ms':>10} {'spawn ms':>10} {'spawn/pool':>11} "
          f"{'isolation us/rank':>18} {'(all ranks / pool)':>18}")
    for r in rows:
        print(f"{r['world_size']:>10} {r['pool_ms']:>9.2f} {r['thread_ms']:>10.2f} "
              f"{r['spawn_ms']:>10.1f} {r['spawn_over_pool']:>10.0f}x "
              f"{r['isolation_us_per_rank']:>18.1f} {r['isolation_share']:>18.1%}")
    summary = {"benchmark": "harness_per_test_overhead", "torch": torch.__version__, "rows": rows}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
