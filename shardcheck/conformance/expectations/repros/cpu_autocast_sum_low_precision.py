"""F4: CPU autocast keeps `sum` in the low-precision dtype (CUDA autocast runs it in fp32), and its
default dtype is bf16: a reference that asserts an fp32 loss under autocast fails on CPU."""

import torch
import torch.nn as nn

from _launch import run, verdict


def body(rank, world_size):
    x = torch.randn(2, 8)
    with torch.autocast("cpu"):
        default = nn.Linear(8, 8)(x).sum().dtype
    with torch.autocast("cpu", dtype=torch.float16):
        fp16 = nn.Linear(8, 8)(x).sum().dtype
    return f"{default} {fp16}"


if __name__ == "__main__":
    results = run(body, world_size=2)
    verdict(all(r == "returned: torch.bfloat16 torch.float16" for r in results.values()),
            "under CPU autocast, Linear(...).sum() stays bf16 (default) / fp16, never fp32", results)
