"""F2: FSDP1 CPUOffload(offload_params=True) on a CPU-only machine fails at the first forward:
_flat_param.py pins memory unconditionally ('Cannot access accelerator device when none is
available'); FSDP1 has no pin_memory=False switch (FSDP2's CPUOffloadPolicy has)."""

import torch
import torch.nn as nn
from torch.distributed.fsdp import CPUOffload
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from _launch import run, verdict


def body(rank, world_size):
    model = FSDP(nn.Linear(4, 4), device_id=torch.device("cpu"), cpu_offload=CPUOffload(offload_params=True))
    model(torch.randn(2, 4)).sum().backward()
    return "forward and backward ran"


if __name__ == "__main__":
    results = run(body, world_size=2)
    symptoms = ("Cannot access accelerator device", "Found no NVIDIA driver")  # CPU build; CUDA build, no GPU
    verdict(all(any(s in r for s in symptoms) for r in results.values()),
            "FSDP1 CPUOffload(offload_params=True) cannot run on CPU: it pins memory unconditionally", results)
