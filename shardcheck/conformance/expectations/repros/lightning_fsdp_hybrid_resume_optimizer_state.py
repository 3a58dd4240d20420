"""F65: Lightning Fabric's FSDPStrategy (FSDP1) with HYBRID_SHARD over a (replicate=2, shard=2) device
mesh: `fabric.save` then `fabric.load` into a fresh run restores the parameters but not the optimizer
state: on every rank Adam's moments after the load differ from the saved ones (the control,
F65_STRATEGY=FULL_SHARD, restores them exactly), so the first step after the load differs from the
uninterrupted run's. FULL_SHARD, SHARD_GRAD_OP and
NO_SHARD resume exactly; torch's own FSDP1 HYBRID_SHARD through DCP's get_state_dict resumes exactly.

On CPU Fabric refuses FSDPStrategy (F30): the lines marked SHIM pass `device_id=cpu` as FSDP1 needs."""

import os
import shutil

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from _launch import run, verdict


def _fabric_run(world_size, mesh, seed):
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import FSDPStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    class CpuFSDPStrategy(FSDPStrategy):  # SHIM (F30)
        def setup_module(self, module):  # SHIM: FSDPStrategy's own wrap, with device_id=cpu
            return FullyShardedDataParallel(module, sharding_strategy=self.sharding_strategy, device_id=torch.device("cpu"),
                                            **self._fsdp_kwargs)

    hybrid = os.environ.get("F65_STRATEGY", "HYBRID_SHARD") == "HYBRID_SHARD"  # FULL_SHARD: the control
    strategy = CpuFSDPStrategy(sharding_strategy=os.environ.get("F65_STRATEGY", "HYBRID_SHARD"),
                               **({"device_mesh": mesh} if hybrid else {}),
                               auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
    fabric.launch()
    torch.manual_seed(seed)
    model = fabric.setup_module(nn.Sequential(nn.Linear(7, 5), nn.ReLU(), nn.Linear(5, 3), nn.ReLU(), nn.Linear(3, 1)))
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-2))
    return fabric, model, optimizer


def _moments(optimizer):
    state = optimizer.optimizer.state_dict()["state"]  # by parameter index
    return [state[i]["exp_avg"].clone() for i in sorted(state)]


def body(rank, world_size):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT="29612")
    path = f"/tmp/shardcheck-f65-{os.getppid()}"
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    fabric, model, optimizer = _fabric_run(world_size, mesh, seed=0)
    torch.manual_seed(100 + rank)
    fabric.backward(model(torch.randn(6, 7)).square().mean())
    optimizer.step()
    saved = _moments(optimizer)
    fabric.save(path, {"model": model, "optimizer": optimizer})
    dist.barrier()
    fabric, model, optimizer = _fabric_run(world_size, mesh, seed=1)
    fabric.load(path, {"model": model, "optimizer": optimizer})
    loaded = _moments(optimizer)
    same = len(saved) == len(loaded) and all(torch.equal(a, b) for a, b in zip(saved, loaded))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    return f"Adam's exp_avg after the load equals the saved one on this rank: {same}"


if __name__ == "__main__":
    results = run(body, world_size=4, timeout_s=60)
    verdict(any("saved one on this rank: False" in r for r in results.values()),
            "Fabric FSDPStrategy HYBRID_SHARD: some rank's optimizer state after fabric.load is not the saved one",
            results)
