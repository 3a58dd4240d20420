"""Models that cross the mixed-precision contract where real models do: a policy per unit, and
floating buffers under `buffer_dtype`. Each layout is a ShardSpec's precision fields, as data.

`PolicyNet` is ``head(block1(norm(block0(inp(x)))))``: four units after the root's own `inp`, so
an activation that requires a gradient crosses every unit boundary, each time into a unit of the
other dtype (rows 8, 8, 5, 1: uneven at world size 4, the head's shards empty on three ranks).

    float32_inside  the root and the blocks compute in bfloat16, `norm` and `head` in float32
                    (a norm and an output head kept in float32, as llama-style models keep them)
    low_inside      the root, `norm` and `head` in float32, the blocks in bfloat16 (the reverse)

`BufferNet` is ``head(tanh(norm(inp(x)))) * scale``: a BatchNorm in training mode (running
statistics updated by every forward) and `scale`, a constant registered buffer the root multiplies
its output by, so its dtype decides the output's.

    buffer_dtype    bfloat16 compute with buffer_dtype bfloat16: every buffer in bfloat16
    own_dtype       bfloat16 compute without buffer_dtype, the BatchNorm in a float32 unit: every
                    buffer stays float32 as built (so the root's output is promoted to float32)

Gradients are reduced in float32 everywhere.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardcheck.conformance.protocol import MixedPrecision

BF16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
FP32 = MixedPrecision(param_dtype=torch.float32, reduce_dtype=torch.float32)
STEPS = 2


class PolicyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.block0 = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.norm = nn.LayerNorm(8)
        self.block1 = nn.Sequential(nn.Linear(8, 5), nn.Tanh())
        self.head = nn.Linear(5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block1(self.norm(self.block0(self.inp(x)))))


class BufferNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.norm = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 1)
        self.register_buffer("scale", torch.tensor([0.7]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.norm(self.inp(x)))) * self.scale


# name: (model, units, the root's policy, {unit path: its own policy}, the capabilities it needs)
LAYOUTS = {
    "float32_inside": (PolicyNet, ("block0", "norm", "block1", "head"), BF16, {"norm": FP32, "head": FP32},
                       {"per_unit_mixed_precision"}),
    "low_inside": (PolicyNet, ("block0", "norm", "block1", "head"), FP32, {"block0": BF16, "block1": BF16},
                   {"per_unit_mixed_precision"}),
    "buffer_dtype": (BufferNet, ("norm", "head"), MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                                 buffer_dtype=torch.bfloat16), {}, {"buffer_dtype"}),
    "own_dtype": (BufferNet, ("norm", "head"), BF16, {"norm": FP32}, {"per_unit_mixed_precision"}),
}


def loss_fn(model, batch) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x).float(), y)


def batches(ctx) -> list:
    """Per step, this rank's (x, y): 4 rows (BatchNorm needs more than one)."""
    out = []
    for step in range(STEPS):
        with ctx.seeded(1000 * step + ctx.rank):
            out.append((torch.randn(4, 6, device=ctx.device), torch.randn(4, 1, device=ctx.device)))
    return out
