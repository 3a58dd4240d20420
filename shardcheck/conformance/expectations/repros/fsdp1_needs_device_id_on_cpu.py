"""F6: FSDP1 without device_id on a CPU-only machine raises at construction ('FSDP needs a non-CPU
accelerator device, but no accelerator device is detected.'); device_id=torch.device("cpu") works."""

import torch
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from _launch import run, verdict


def body(rank, world_size):
    FSDP(nn.Linear(5, 5), device_id=torch.device("cpu"))(torch.randn(2, 5))  # the workaround works
    FSDP(nn.Linear(5, 5))
    return "FSDP without device_id was built"


if __name__ == "__main__":
    results = run(body, world_size=2)
    verdict(all("FSDP needs a non-CPU accelerator device" in r for r in results.values()),
            "FSDP1 without device_id raises on CPU; with device_id='cpu' it runs", results)
