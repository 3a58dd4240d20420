"""F8: FSDP1's fp16/bf16_compress_hook call tensor.record_stream(torch.cpu.current_stream())
(default_hooks.py), which has no CPU kernel: backward fails with 'unknown parameter type'."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms._comm_hooks import default_hooks
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy

from _launch import run, verdict


def body(rank, world_size):
    model = FSDP(nn.Linear(4, 4), device_id=torch.device("cpu"), sharding_strategy=ShardingStrategy.NO_SHARD)
    model.register_comm_hook(default_hooks.LowPrecisionState(dist.group.WORLD), default_hooks.fp16_compress_hook)
    model(torch.randn(2, 4)).sum().backward()
    return "backward with fp16_compress_hook ran"


if __name__ == "__main__":
    results = run(body, world_size=2)
    verdict(all("unknown parameter type" in r for r in results.values()),
            "fp16_compress_hook fails on CPU: record_stream has no CPU kernel", results)
