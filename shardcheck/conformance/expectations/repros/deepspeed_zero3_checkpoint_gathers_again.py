"""F50: DeepSpeed ZeRO-3 with a layer checkpointed by torch.utils.checkpoint (non-reentrant, as
Hugging Face models and torch users write it) gathers that layer's parameters once more per step:
the recomputed forward in backward fetches them and its end releases them, so the layer's backward
fetches them again. Without checkpointing a step gathers fewer bytes; FSDP2 (and shardcheck's
reference) reuse what the recompute gathered."""

import os
import re

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from _collectives import counting
from _launch import run, verdict


class Net(nn.Module):
    def __init__(self, checkpointed):
        super().__init__()
        self.embed, self.layer, self.head = nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Linear(8, 1)
        self.checkpointed = checkpointed

    def forward(self, x):
        h = self.embed(x)
        return self.head(checkpoint(self.layer, h, use_reentrant=False) if self.checkpointed else self.layer(h))


def gathered(ds, checkpointed, world_size):
    torch.manual_seed(0)
    model = Net(checkpointed)
    engine, *_ = ds.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config={
        "train_batch_size": world_size, "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True})
    with counting() as seen:
        engine.backward(engine(torch.ones(2, 8)).sum())
    return seen.seen["allgather"][1]


def body(rank, world_size):
    os.environ.update(LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no JIT build of the shm op
    return (f"bytes all-gathered by forward and backward: without checkpointing {gathered(deepspeed, False, world_size)}, "
            f"with it {gathered(deepspeed, True, world_size)}")


if __name__ == "__main__":
    results = run(body, world_size=2, timeout_s=120)
    sizes = [[int(n) for n in re.findall(r"checkpointing (\d+), with it (\d+)", r)[0]] if "with it" in r else []
             for r in results.values()]
    verdict(all(len(s) == 2 and s[1] > s[0] for s in sizes),
            "ZeRO-3 gathers a checkpointed layer's parameters again after its recomputed forward", results)
