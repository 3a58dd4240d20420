"""F67: `DTensor.full_tensor()` promises a finished tensor (it redistributes with async_op=False, which
waits an AsyncCollectiveTensor result), but the wait looks at the outer type only: for a DTensor whose
local tensor is a wrapper subclass (TwoTensor here, as FSDP2's all-gather extension parameters are),
the subclass comes back holding one AsyncCollectiveTensor per component, both all-gathers in flight.
On gloo, functional all-gathers in flight together can corrupt the heap: a rank aborts with
"malloc(): unaligned tcache chunk detected" about once in 10,000 pairs (2 ranks on 2 cores); one at a
time, or c10d's own async all-gathers two at a time, did not in 40,000.

By default the deterministic half: the components are still in flight. `--stress N` also runs N
pairs of plain functional all-gathers in flight together and says whether a rank died."""

import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from _launch import run, verdict

from shardcheck.conformance.checks.support.subclasses import TwoTensor  # torch's test subclass, ported


def in_flight(rank, world_size):
    mesh = init_device_mesh("cpu", (world_size,))
    local = TwoTensor(torch.full((2, 3), float(rank)), torch.full((2, 3), -float(rank)))
    full = DTensor.from_local(local, mesh, [Shard(0)], run_check=False).full_tensor()  # async_op=False
    kinds = f"{type(full).__name__}({type(full.a).__name__}, {type(full.b).__name__})"
    full.a.wait(), full.b.wait()
    return kinds


def two_in_flight(rank, world_size, pairs):
    for i in range(pairs):
        a = funcol.all_gather_tensor(torch.full((4, 8), float(rank + i)), 0, dist.group.WORLD)
        b = funcol.all_gather_tensor(torch.full((4, 8), -float(rank + i)), 0, dist.group.WORLD)
        a, b = a.to(torch.float64), b.to(torch.float64)  # waits a, then b
        assert a[-1, 0] == i + 1 and b[-1, 0] == -i - 1, i
    return f"{pairs} pairs, no abort"


if __name__ == "__main__":
    if "--stress" in sys.argv:
        pairs = int(sys.argv[sys.argv.index("--stress") + 1])
        died = run(lambda rank, ws: two_in_flight(rank, ws, pairs), world_size=2, timeout_s=30)
        print(f"stress ({pairs} pairs of functional all-gathers in flight): "
              f"{'a rank died' if any(r == 'hung' for r in died.values()) else 'no rank died'}: {died}")
    results = run(in_flight, world_size=2)
    verdict(all("AsyncCollectiveTensor" in r for r in results.values()),
            "full_tensor() of a DTensor over a wrapper subclass returns with its components' all-gathers "
            "in flight (AsyncCollectiveTensor), though it redistributes with async_op=False", results)
