"""F22: FSDP1 (use_orig_params=True) gives a FROZEN parameter (requires_grad=False) a gradient inside
summon_full_params(with_grads=True): a zero-filled view of the flat gradient, where unsharded
training and FSDP1's own sharded views (outside the context) have None. `_use_unsharded_grad_views`
assigns a view to every original parameter, `_use_sharded_grad_views` skips frozen ones. Code that
reads full gradients there (logging, checkpointing, norms) sees a frozen parameter as trained.
Found by `shardcheck explore`."""

import torch
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from _launch import run, verdict


def body(rank, world_size):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 2, bias=False), nn.Linear(2, 1, bias=False))
    model[0].requires_grad_(False)
    model = FSDP(model, device_id=torch.device("cpu"), use_orig_params=True)
    model(torch.ones(3, 2)).sum().backward()
    outside = next(model.parameters()).grad
    with FSDP.summon_full_params(model, with_grads=True):
        frozen = model.module[0].weight
        inside = None if frozen.grad is None else frozen.grad.tolist()
    return f"frozen weight: grad outside {outside}, inside summon_full_params {inside}"


if __name__ == "__main__":
    results = run(body, world_size=2)
    verdict(all("outside None" in r and "inside summon_full_params None" not in r for r in results.values()),
            "a frozen parameter has a gradient inside summon_full_params(with_grads=True), None outside", results)
