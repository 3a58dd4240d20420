"""F34: with its default configuration a DeepSpeed ZeRO-3 engine shards nothing of a small model and
holds 2 GB on every rank for it: (a) parameters smaller than `stage3_param_persistence_threshold`
(default 1e5 elements) are never partitioned, every rank keeps them whole (`ds_persist`), and
(b) the gradient reduce bucket is allocated at `reduce_bucket_size` elements (default 5e8: 2 GB in
float32) when the engine is built, whatever the model's size, and held for the engine's life.
(ZeRO-1/2 allocate the same bucket during backward and free it.)"""

import os

import torch
import torch.nn as nn

from _launch import run, verdict


def body(rank, world_size):
    os.environ.update(DS_ACCELERATOR="cpu", LOCAL_RANK=str(rank))
    import deepspeed

    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
    optimizer = torch.optim.Adam(model.parameters())
    config = {"train_batch_size": 4 * world_size, "zero_optimization": {"stage": 3}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    params = sum(p.ds_numel for p in model.parameters())
    bucket = max(t.numel() * t.element_size() for t in _tensors_of(engine.optimizer))
    whole = sum(bool(getattr(p, "ds_persist", False)) for p in model.parameters())
    return (f"{params} parameters, {whole} of {len(list(model.parameters()))} kept whole, "
            f"largest buffer held {bucket / 1e9:.2f} GB")


def _tensors_of(optimizer):
    seen = []
    for bucket in getattr(optimizer, "ipg_buckets", {}).values():
        if getattr(bucket, "buffer", None) is not None:
            seen.append(bucket.buffer)
    return seen or [torch.empty(0)]


if __name__ == "__main__":
    results = run(body, world_size=2, timeout_s=300)
    verdict(all("16640 parameters, 8 of 8 kept whole, largest buffer held 2.00 GB" in str(r) for r in results.values()),
            "ZeRO-3 keeps every parameter of a 16,640-parameter model whole and holds a 2 GB bucket for it", results)
