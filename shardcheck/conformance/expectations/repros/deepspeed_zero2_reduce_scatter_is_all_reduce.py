"""F35: DeepSpeed ZeRO-2 (with `reduce_scatter: true`, the default; ZeRO-1 too, where that is SHARD_OPTIMIZER's
promise) reduces the gradients with
an all-reduce of the whole gradient (`use_multi_rank_bucket_allreduce`, also on by default, turns the
buckets that span several ranks' partitions into all-reduces), then all-gather the updated
parameters: per step a rank sends 3 x P x (n-1)/n bytes for P bytes of parameters, 1.5x the
2 x P x (n-1)/n of a reduce-scatter and an all-gather (FSDP's SHARD_GRAD_OP, ZeRO-2's own design)."""

import os

import torch
import torch.nn as nn

from _collectives import counting
from _launch import run, verdict


def body(rank, world_size):
    os.environ.update(DS_ACCELERATOR="cpu", LOCAL_RANK=str(rank))
    import deepspeed

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
    config = {"train_batch_size": 4 * world_size, "zero_optimization": {"stage": 2}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.Adam(model.parameters()), config=config)
    with counting() as seen:
        engine.backward(engine(torch.randn(4, 64)).pow(2).mean())
        engine.step()
    return f"P {sum(p.numel() * 4 for p in model.parameters())} bytes; {seen.table()}"


if __name__ == "__main__":
    results = run(body, world_size=2, timeout_s=300)
    verdict(all("allreduce" in r and "reduce_scatter" not in r for r in results.values()),
            "ZeRO-2 all-reduces the whole gradient (no reduce-scatter), then all-gathers the parameters", results)
