"""F54: DistributedDataParallel keeps the requires_grad its parameters had when it was built. A
layer unfrozen after wrapping gets no gradient hook: its gradient is never averaged, with or without
`find_unused_parameters=True` (DDP's documentation: the reduction functions are registered at
construction, "you should never try to change your model's parameters after wrapping"). A layer
frozen after wrapping is DDP's documented case for `find_unused_parameters=True`: without it the
layer's bucket stays incomplete, so the other gradients sharing the bucket are not averaged in the
step that follows (the next iteration raises "Expected to have finished reduction", which names the
flag); with it every gradient is averaged. The freeze half was the adapter's use, not DDP's."""

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


def freeze(rank, **ddp) -> bool:
    torch.manual_seed(0)
    frozen_later = DDP(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)), **ddp)
    step(frozen_later, rank)
    frozen_later.module[0].requires_grad_(False)
    return step(frozen_later, rank)


def unfreeze(rank, **ddp) -> bool:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    plain[0].requires_grad_(False)
    unfrozen_later = DDP(plain, **ddp)
    step(unfrozen_later, rank)
    plain[0].requires_grad_(True)
    return step(unfrozen_later, rank)


def body(rank, world_size):
    return (f"gradients averaged: after freezing {freeze(rank)} (find_unused_parameters=True: "
            f"{freeze(rank, find_unused_parameters=True)}), after unfreezing {unfreeze(rank)} "
            f"(find_unused_parameters=True: {unfreeze(rank, find_unused_parameters=True)})")


if __name__ == "__main__":
    results = run(body, world_size=2, timeout_s=60)
    verdict(all("after freezing False (find_unused_parameters=True: True), after unfreezing False "
                "(find_unused_parameters=True: False)" in str(r) for r in results.values()),
            "DDP never averages a layer unfrozen after wrapping, find_unused_parameters or not; a layer frozen "
            "after wrapping needs find_unused_parameters=True, as DDP documents, and is averaged with it",
            results)
