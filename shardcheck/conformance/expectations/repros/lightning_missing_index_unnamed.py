"""F64: Lightning Fabric's load of a sharded checkpoint whose index is gone (DCP's `.metadata` and
Fabric's `meta.pt` deleted) raises "The path '<dir>' does not point to a valid checkpoint. Make sure
the path points to either a directory with distributed checkpoint shards, or a single file with a
full checkpoint.", naming neither missing file: the shards are all there, and nothing says what the
directory lacks. (A missing or damaged shard, a truncated index and another model's shapes are
named, by DCP underneath.)"""

import os
import shutil

import torch
import torch.distributed as dist
import torch.nn as nn

from _launch import run, verdict


def body(rank, world_size):
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT="29611")
    path = f"/tmp/shardcheck-f64-{os.getppid()}"
    strategy = ModelParallelStrategy(lambda m, mesh: fully_shard(m, mesh=mesh["data_parallel"]),
                                     data_parallel_size=world_size, tensor_parallel_size=1)
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
    fabric.launch()
    model = fabric.setup_module(nn.Sequential(nn.Linear(7, 5), nn.Linear(5, 1)))
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-2))
    fabric.save(path, {"model": model, "optimizer": optimizer})
    dist.barrier()
    if rank == 0:
        for name in (".metadata", "meta.pt"):
            os.remove(os.path.join(path, name))
    dist.barrier()
    try:
        fabric.load(path, {"model": model, "optimizer": optimizer})
        outcome = "loaded"
    except Exception as exc:
        named = ".metadata" in str(exc) or "meta.pt" in str(exc)
        outcome = f"{type(exc).__name__} naming a missing file: {named}: {str(exc)[:90]}"
    dist.barrier()
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    return outcome


if __name__ == "__main__":
    results = run(body, world_size=2, timeout_s=60)
    verdict(all("ValueError naming a missing file: False" in r for r in results.values()),
            "Fabric's load without the index names no missing file", results)
