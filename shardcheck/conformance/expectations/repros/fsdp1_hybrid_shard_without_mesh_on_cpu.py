"""F62: FSDP1 HYBRID_SHARD given no process groups and no device mesh (what Accelerate's FSDP1 plugin
passes: it has no field for either) builds its shard groups from the accelerator devices per node
(`_init_intra_and_inter_node_groups`): on a CPU machine groups of one rank. As in F21, a shard group
of one rank switches the unit to NO_SHARD over that group, which all-reduces across nobody: every rank
keeps its own gradient divided by the world size, the replicas train on their own data and drift
apart, with no error. (On a GPU node the shard group is the node's devices.)"""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from _launch import run, verdict


def body(rank, world_size):
    torch.manual_seed(0)
    # an auto_wrap_policy, as Accelerate always passes one (FSDP1 refuses manual HYBRID_SHARD wrapping
    # without groups; with a policy it builds them)
    model = FSDP(nn.Sequential(nn.Linear(2, 1, bias=False)), sharding_strategy=ShardingStrategy.HYBRID_SHARD,
                 auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), device_id=torch.device("cpu"), use_orig_params=True)
    shard_size = dist.get_world_size(model.process_group)
    model(torch.full((1, 2), float(rank + 1))).sum().backward()  # rank r's gradient: (r + 1, r + 1)
    with FSDP.summon_full_params(model, with_grads=True):
        grad = next(model.parameters()).grad.clone()
    expected = sum(r + 1 for r in range(world_size)) / world_size  # the data-parallel average
    gathered = [torch.zeros_like(grad) for _ in range(world_size)]
    dist.all_gather(gathered, grad)
    same = all(torch.equal(g, gathered[0]) for g in gathered)
    return f"shard group of {shard_size}; grad {grad.flatten().tolist()} (average {expected}); equal on all ranks: {same}"


if __name__ == "__main__":
    results = run(body, world_size=4)
    verdict(all("shard group of 1;" in r and "equal on all ranks: False" in r for r in results.values()),
            "FSDP1 HYBRID_SHARD without groups on CPU: shard groups of one rank, gradients never averaged", results)
