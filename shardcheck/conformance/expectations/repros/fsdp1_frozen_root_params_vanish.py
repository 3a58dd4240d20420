"""F23: FSDP1 (use_orig_params=True, NO_SHARD, or any strategy at world size 1, which FSDP1 turns into
NO_SHARD) drops a unit's parameters from named_parameters() when all of them are frozen: with
trainable sub-units and a root whose own parameters are all frozen, after the first forward/backward
the root's frozen parameters are no longer listed by model.named_parameters() (nor inside
summon_full_params), though they are before it. FULL_SHARD at world size 2 keeps them. Code that
walks named_parameters (full-parameter comparisons, logging, EMA copies) silently loses them.
Found by `shardcheck explore`."""

import torch
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy

from _launch import run, verdict


def body(rank, world_size):
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(1, 1, bias=False) for _ in range(4)))
    model[1].requires_grad_(False)  # the root's own parameters (1, 2): all frozen
    model[2].requires_grad_(False)
    for i in (0, 3):  # trainable sub-units
        model[i] = FSDP(model[i], device_id=torch.device("cpu"), use_orig_params=True)
    model = FSDP(model, device_id=torch.device("cpu"), use_orig_params=True,
                 sharding_strategy=ShardingStrategy.NO_SHARD)
    before = sorted(n.replace("_fsdp_wrapped_module.", "") for n, _ in model.named_parameters())
    model(torch.ones(3, 1)).sum().backward()
    after = sorted(n.replace("_fsdp_wrapped_module.", "") for n, _ in model.named_parameters())
    return f"named_parameters before {before}, after forward/backward {after}"


if __name__ == "__main__":
    results = run(body, world_size=2)
    verdict(all("'1.weight'" in r.split("after")[0] and "'1.weight'" not in r.split("after")[1]
                for r in results.values()),
            "the root's frozen parameters are listed by named_parameters() before the first step, not after", results)
