"""F16: torch DDP's own mixed precision (`DistributedDataParallel(mixed_precision=_MixedPrecision(...))`,
experimental) cannot run on CPU: its forward records a device event for the low-precision
parameter copies, and the CPU backend has no events: "cpu backend doesn't support events". torch 2.14.1
creates a device stream when DDP is built and fails there ("Backend doesn't support create a new
Stream"; on a CUDA build without a GPU "CUDA driver version is insufficient")."""

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
    symptoms = ("doesn't support events", "doesn't support create a new Stream", "CUDA driver version is insufficient")
    verdict(all(any(s in r for s in symptoms) for r in results.values()),
            "DDP's mixed precision raises on CPU: the backend has no events (or streams)", results)
