"""Per-test overhead of each launch mode: `python -m harness.bench`.

The test body does one all_reduce, so what is measured is the harness: start-up (spawn), or
dispatch + barrier + result collection (pool, thread). Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist

from harness.runner import run, shutdown_pools


def one_all_reduce(ctx) -> None:
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == ctx.world_size


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
        thread = per_test_seconds(ws, "thread", args.repeats)
        spawn = per_test_seconds(ws, "spawn", args.spawn_repeats)
        shutdown_pools()
        rows.append({"world_size": ws, "pool_ms": pool * 1e3, "thread_ms": thread * 1e3,
                     "spawn_ms": spawn * 1e3, "spawn_over_pool": spawn / pool})
    print(f"{'world size':>10} {'pool ms':>9} {'thread ms':>10} {'spawn ms':>10} {'spawn/pool':>11}")
    for r in rows:
        print(f"{r['world_size']:>10} {r['pool_ms']:>9.2f} {r['thread_ms']:>10.2f} "
              f"{r['spawn_ms']:>10.1f} {r['spawn_over_pool']:>10.0f}x")
    summary = {"benchmark": "harness_per_test_overhead", "torch": torch.__version__, "rows": rows}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
