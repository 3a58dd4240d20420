"""F21: FSDP1 HYBRID_SHARD on a (replicate=2, shard=1) device mesh never averages gradients across
the replicas. FSDP1 sees a shard group of one rank, switches the strategy to NO_SHARD ("FSDP is
switching to use `NO_SHARD` instead of ShardingStrategy.HYBRID_SHARD since the world size is 1"),
and NO_SHARD all-reduces over that one-rank group only: each rank keeps its own gradient (divided
by the world size), so the replicas train on their own data and drift apart. Found by `shardcheck explore`."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy

from _launch import run, verdict


def body(rank, world_size):
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("replicate", "shard"))
    model = FSDP(nn.Linear(2, 1, bias=False), sharding_strategy=ShardingStrategy.HYBRID_SHARD,
                 device_mesh=mesh, device_id=torch.device("cpu"), use_orig_params=True)
    model(torch.full((1, 2), float(rank + 1))).sum().backward()  # rank r's gradient: (r + 1, r + 1)
    with FSDP.summon_full_params(model, with_grads=True):
        grad = next(model.parameters()).grad.clone()
    expected = sum(r + 1 for r in range(world_size)) / world_size  # the data-parallel average
    gathered = [torch.zeros_like(grad) for _ in range(world_size)]
    dist.all_gather(gathered, grad)
    same = all(torch.equal(g, gathered[0]) for g in gathered)
    return f"grad {grad.tolist()} (average {expected}); equal on all ranks: {same}"


if __name__ == "__main__":
    results = run(body, world_size=2)
    verdict(all("equal on all ranks: False" in r for r in results.values()),
            "HYBRID_SHARD on a (2, 1) mesh: gradients differ across ranks, each rank's own gradient / 2 "
            "instead of the average (no all-reduce across the replicas)", results)
