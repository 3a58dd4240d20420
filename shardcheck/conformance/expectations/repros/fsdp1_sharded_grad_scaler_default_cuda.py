"""F3: ShardedGradScaler() defaults to device="cuda"; on a CUDA-less machine it warns and disables
itself, so scale() returns its input unchanged and a test using it passes vacuously."""

import torch
import torch.distributed as dist
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from _launch import run, verdict


def body(rank, world_size):
    scaler = ShardedGradScaler(init_scale=2.0, process_group=dist.group.WORLD, enabled=True)
    scaled = scaler.scale(torch.tensor(8.0))
    return f"enabled={scaler.is_enabled()} scale(8.0)={scaled.item()}"


if __name__ == "__main__":
    results = run(body, world_size=2)
    verdict(all(r == "returned: enabled=False scale(8.0)=8.0" for r in results.values()),
            "ShardedGradScaler(enabled=True) without device= is disabled on CPU (scale(8.0) == 8.0)", results)
