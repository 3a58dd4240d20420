"""F16: torch DDP's own mixed precision (`DistributedDataParallel(mixed_precision=_MixedPrecision(...))`,
experimental) cannot run on CPU: its forward records a device event for the low-precision
parameter copies, and the CPU backend has no events: "cpu backend doesn't support events"."""

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.parallel.distributed import _MixedPrecision

from _launch import run, verdict


def body(rank, world_size):
    model = DDP(nn.Linear(4, 4), mixed_precision=_MixedPrecision(param_dtype=torch.bfloat16,
                                                                reduce_dtype=torch.float32))
    model(torch.randn(2, 4)).sum().backward()
    return "trained a step"


if __name__ == "__main__":
    results = run(body, world_size=2)
    verdict(all("doesn't support events" in r for r in results.values()),
            "DDP's mixed precision raises on CPU: the backend has no events", results)
