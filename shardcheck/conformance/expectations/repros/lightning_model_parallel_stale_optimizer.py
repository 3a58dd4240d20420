"""F29: Lightning Fabric's `ModelParallelStrategy` (FSDP2 through a parallelize_fn calling
`fully_shard`) with `model, optimizer = fabric.setup(model, optimizer)`, the optimizer built before
sharding (the pattern FSDPStrategy accepts): `fully_shard` replaces every parameter by a DTensor
parameter, the optimizer keeps the old ones, and nothing re-links or warns. They never get a gradient:
`fabric.clip_gradients` (over the optimizer's parameters) reports a total norm of 0 and
`optimizer.step()` leaves the model unchanged. In memory: every rank keeps the whole pre-sharding
model alive in the optimizer beside its DTensor shard. Runs on CPU as shipped (no shim)."""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from _launch import run, verdict


def body(rank, world_size):
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size))  # as torchrun sets them

    def parallelize(model, mesh):
        fully_shard(model, mesh=mesh["data_parallel"])
        return model

    fabric = Fabric(accelerator="cpu", devices=world_size,
                    strategy=ModelParallelStrategy(parallelize, data_parallel_size=world_size, tensor_parallel_size=1))
    fabric.launch()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    before = [p.detach().full_tensor() for p in model.parameters()]
    fabric.backward(F.mse_loss(model(torch.randn(2, 4)), torch.ones(2, 1)))
    norm = fabric.clip_gradients(model, optimizer, max_norm=1.0)
    optimizer.step()
    moved = any(not torch.equal(a, p.detach().full_tensor()) for a, p in zip(before, model.parameters()))
    grads = sum(p.grad is not None for p in model.parameters())
    stale = [q for group in optimizer.param_groups for q in group["params"]]
    full = sum(q.numel() * q.element_size() for q in stale)  # the pre-sharding parameters, alive in the optimizer
    shard = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    return (f"module params with a grad: {grads}; clip_gradients total norm: {float(norm)}; model changed by step: "
            f"{moved}; parameter bytes held: the rank's shard {shard} + the optimizer's unsharded copy {full} "
            f"(= {(shard + full) / full:.2f}x of the model)")


if __name__ == "__main__":
    results = run(body, world_size=2, timeout_s=60)
    verdict(all("module params with a grad: 4; clip_gradients total norm: 0.0; model changed by step: False" in r
                and "the optimizer's unsharded copy 100 " in r for r in results.values()),
            "ModelParallelStrategy + fabric.setup(model, optimizer): stale optimizer, norm 0, no update", results)
