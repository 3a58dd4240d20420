"""What one small gloo collective costs on this machine: `python -m shardcheck.harness.collective_bench`.

World sizes 2 and 4, ranks forked and placed three ways: one CPU each in turn (what pool ranks do,
`worker.pin_to_one_cpu`), all on the first CPU, and free to float. Each rank all-reduces 10 floats
`--calls` times; rank 0 reports the wall time per call and its own CPU per call (user and kernel),
which on a shared machine is what a collective costs every other test. Prints a table, then one
JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shardcheck.harness.worker import pin_threads, pin_to_one_cpu

PLACEMENTS = ("one CPU each", "one CPU for all", "unpinned")


def _rank(rank: int, world_size: int, store_path: str, placement: str, calls: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size)
    if placement == "one CPU each":  # as pool ranks are pinned, gloo's threads with them
        pin_to_one_cpu(rank, world_size)
    elif placement == "one CPU for all":
        pin_threads({min(os.sched_getaffinity(0))})
    tensor = torch.ones(10)
    for _ in range(20):  # warm-up: connections, first-call paths
        dist.all_reduce(tensor)
    dist.barrier()
    before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for _ in range(calls):
        dist.all_reduce(tensor)
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"wall_ms": 1e3 * wall / calls, "user_us": 1e6 * (after.ru_utime - before.ru_utime) / calls,
                       "sys_us": 1e6 * (after.ru_stime - before.ru_stime) / calls}, f)
    dist.destroy_process_group()


def measure(world_size: int, placement: str, calls: int) -> dict:
    """{"wall_ms", "user_us", "sys_us"} per all-reduce, rank 0's view."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.json")
        mp.start_processes(_rank, args=(world_size, os.path.join(tmp, "store"), placement, calls, out),
                           nprocs=world_size, start_method="fork")
        with open(out) as f:
            return json.load(f)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1500)
    parser.add_argument("--world-sizes", default="2,4")
    args = parser.parse_args(argv)
    print(f"{'world':>5}  {'placement':<16} {'wall ms':>8} {'user us':>8} {'kernel us':>9}")
    rows = []
    for world_size in map(int, args.world_sizes.split(",")):
        for placement in PLACEMENTS:
            row = {"world_size": world_size, "placement": placement, **measure(world_size, placement, args.calls)}
            rows.append(row)
            print(f"{world_size:>5}  {placement:<16} {row['wall_ms']:8.3f} {row['user_us']:8.0f} {row['sys_us']:9.0f}",
                  flush=True)
    result = {"benchmark": "gloo_all_reduce_10_floats", "cpus": len(os.sched_getaffinity(0)), "rows": rows}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
