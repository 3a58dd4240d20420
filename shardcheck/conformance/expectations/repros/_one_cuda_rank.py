"""What the CUDA-only reproductions share: one rank on one CUDA device (nccl, world size 1), and the
model explore drew when it found them (Linear blocks, tanh between them).

    one_cuda_rank(body)   # {0: "returned: ..." | "raised Type: msg"}; without a CUDA device, prints
                          # "NOT RUN: ..." and exits 2 (these findings exist only on a GPU)
"""

from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, n_in, n_out, bias, buffer):
        super().__init__()
        self.lin = nn.Linear(n_in, n_out, bias=bias)
        if buffer:
            self.register_buffer("shift", torch.linspace(-0.25, 0.25, n_out))

    def forward(self, x):
        y = self.lin(x)
        return y + self.shift.to(y.dtype) if hasattr(self, "shift") else y


class Net(nn.Module):
    """Blocks 1->1->3->1->4 (a bias on the third only), tanh between them; `frozen` blocks do not
    require gradients; `buffers` blocks add a buffer to their output."""

    def __init__(self, frozen=(), buffers=()):
        super().__init__()
        widths, bias = [1, 1, 3, 1, 4], [False, False, True, False]
        self.blocks = nn.ModuleList(Block(widths[i], widths[i + 1], bias[i], i in buffers) for i in range(4))
        for i in frozen:
            self.blocks[i].requires_grad_(False)

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i < len(self.blocks) - 1:
                x = torch.tanh(x)
        return x


def make(frozen=(), buffers=()) -> Net:
    torch.manual_seed(0)
    return Net(frozen, buffers).cuda()


def one_cuda_rank(body) -> dict[int, str]:
    if not torch.cuda.is_available():
        print("NOT RUN: this finding is on CUDA only; the script needs one CUDA device")
        sys.exit(2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        result = f"returned: {body()}"
    except Exception as exc:  # the failure under study
        result = f"raised {type(exc).__name__}: {str(exc).strip().splitlines()[0]}"
    finally:
        dist.destroy_process_group()
    return {0: result}
