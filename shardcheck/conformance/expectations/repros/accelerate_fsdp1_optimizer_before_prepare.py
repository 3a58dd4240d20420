"""F28: Accelerate's FSDP1 path with `model, optimizer = accelerator.prepare(model, optimizer)`, the
optimizer built over the unsharded model (the usual script): prepare wraps the model in FSDP1
(use_orig_params=False, the plugin's default) and leaves the optimizer holding the original
parameters, which are no longer the module's: they never get a gradient, `optimizer.step()` changes
nothing the model uses, and nothing warns. (FSDP2's prepare swaps the optimizer's parameters; FSDP1's
does not.) In memory: every rank keeps the whole unsharded model alive beside its shard (about 1.5x of
the model's parameter bytes at 2 ranks, where FULL_SHARD holds about 0.5x).

On a CPU-only machine Accelerate does not build FSDP at all (F27): the four lines marked SHIM give
the state what accelerate/state.py gives it on a GPU machine. The failure is in prepare's handling of
the optimizer, not in the shim."""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from _launch import run, verdict


def body(rank, world_size):
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    plugin = FullyShardedDataParallelPlugin(fsdp_version=1)
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    for state in (PartialState(), accelerator.state):  # SHIM (F27)
        state.distributed_type = DistributedType.FSDP  # SHIM
        state.device = torch.device("cpu")  # SHIM
    accelerator.state.fsdp_plugin = plugin  # SHIM
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    before = [p.detach().clone() for p in model.parameters()]
    accelerator.backward(F.mse_loss(model(torch.randn(2, 4)), torch.ones(2, 1)))
    optimizer.step()
    held = optimizer.optimizer.param_groups[0]["params"]
    moved = any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    full = sum(q.numel() * q.element_size() for q in held)  # the original parameters, kept alive by the optimizer
    shard = sum(p.numel() * p.element_size() for p in model.parameters())  # FSDP1's flat parameter shard
    return (f"{type(model).__name__}; optimizer holds module params: {any(q is p for q in held for p in model.parameters())}; "
            f"optimizer params with a grad: {sum(q.grad is not None for q in held)}; model changed by step: {moved}; "
            f"parameter bytes held: the rank's shard {shard} + the optimizer's unsharded copy {full} "
            f"(= {(shard + full) / full:.2f}x of the model)")


if __name__ == "__main__":
    results = run(body, world_size=2, timeout_s=60)
    verdict(all("FullyShardedDataParallel; optimizer holds module params: False; optimizer params with a grad: 0; "
                "model changed by step: False" in r and "the optimizer's unsharded copy 76 " in r for r in results.values()),
            "FSDP1 prepare(model, optimizer): the optimizer keeps the unsharded parameters, training is a no-op",
            results)
