"""F48 in DeepSpeed ZeRO (every stage): the engine broadcasts buffers once, when it is built, never
again, where DDP broadcasts rank 0's before forward: BatchNorm's running statistics follow each
rank's own batches, and after one training step the ranks evaluate one input to different outputs."""

import os

import torch
import torch.nn as nn

from _buffers import evaluation_spread
from _launch import run, verdict


def body(rank, world_size):
    os.environ.update(LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no JIT build of the shm op
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config={
        "train_batch_size": world_size, "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True})
    torch.manual_seed(1 + rank)  # each rank its own batch
    engine.backward(engine(torch.randn(8, 4)).sum())
    engine.step()
    return f"one input evaluated on every rank, largest difference {evaluation_spread(engine):.3g}"


if __name__ == "__main__":
    results = run(body, world_size=2, timeout_s=120)
    verdict(all("largest difference" in r and not r.endswith("difference 0") for r in results.values()),
            "DeepSpeed leaves BatchNorm's running statistics different on every rank (DDP: rank 0's)", results)
