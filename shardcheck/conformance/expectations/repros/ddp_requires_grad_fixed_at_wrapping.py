"""F54: DistributedDataParallel keeps the requires_grad its parameters had when it was built. A
fine-tuning schedule that freezes a layer after some steps leaves that layer's bucket incomplete,
so the other gradients sharing the bucket are not averaged in the step that follows (no error in that
step; the next iteration's prepare_for_backward raises "Expected to have finished reduction"). A
layer unfrozen later gets no gradient hook: its gradient is never averaged, silently."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from _launch import run, verdict


def averaged(model) -> bool:
    """Whether every gradient is the same on every rank (DDP's promise)."""
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    spread = flat.clone()
    dist.all_reduce(spread, op=dist.ReduceOp.MAX)
    return bool(torch.equal(spread, flat))


def step(model, rank) -> bool:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(rank)  # a different batch per rank
    model(torch.randn(3, 4)).sum().backward()
    return averaged(model)


def body(rank, world_size):
    torch.manual_seed(0)
    frozen_later = DDP(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)))
    step(frozen_later, rank)
    frozen_later.module[0].requires_grad_(False)
    after_freeze = step(frozen_later, rank)
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    plain[0].requires_grad_(False)
    unfrozen_later = DDP(plain)
    step(unfrozen_later, rank)
    plain[0].requires_grad_(True)
    after_unfreeze = step(unfrozen_later, rank)
    return f"gradients averaged: after freezing {after_freeze}, after unfreezing {after_unfreeze}"


if __name__ == "__main__":
    results = run(body, world_size=2, timeout_s=60)
    verdict(all("after freezing False, after unfreezing False" in str(r) for r in results.values()),
            "DDP averages no gradient of a bucket whose layer was frozen after wrapping, nor a layer unfrozen after it",
            results)
