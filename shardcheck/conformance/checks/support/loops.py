"""The training loops users run, as data: one model with every loop shape's parts, the shapes
(spec.Recipe fields), the precision policies and every rank's micro-batches.

`LoopNet` is ``head(tanh(decode(h + body(h))))`` with ``h = tanh(embed(x))``: `body` is a unit of
its own whose input carries a gradient (for the input cast's autograd), rows of 6, 4 and 1 leave
trailing ranks of 4 with fewer rows or none. A shape changes one thing:

    accumulate          3 micro-batches per step, gradients synced on every one
    accumulate_no_sync  3 micro-batches per step, synced on the last only
    eval_between        an eval forward before each step (step 0's first forward has no grad)
    frozen              embed's parameters do not require gradients
    unused              `spare` is never called: its parameters get no gradient on any rank
    tied                decode.weight IS embed.weight (one parameter, two modules)
    plain               none of these (the low-precision-gradient cells)

The fine-tuning schedules (SCHEDULES) change requires_grad between steps (Recipe.requires_grad_at):

    unfreeze            `body` (a unit of its own) frozen as built, unfrozen before step 1: its
                        first forwards run with every parameter of the unit frozen
    unfreeze_after_eval the same with an evaluation forward before each step
    freeze              `body` trained at step 0, frozen before step 1
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardcheck.conformance.protocol import MixedPrecision


class LoopNet(nn.Module):
    def __init__(self, shape: str = "plain") -> None:
        super().__init__()
        self.embed = nn.Linear(6, 6)
        self.body = nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 6))
        self.decode = nn.Linear(6, 6)
        self.head = nn.Linear(6, 1)
        if shape == "unused":
            self.spare = nn.Linear(3, 2)
        if shape == "tied":
            self.decode.weight = self.embed.weight
        if shape == "frozen":
            self.embed.requires_grad_(False)
        if shape.startswith("unfreeze"):
            self.body.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        return self.head(torch.tanh(self.decode(h + self.body(h))))


def loss_fn(model, batch) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x).float(), y)


def _builder(shape: str):
    def build() -> nn.Module:
        return LoopNet(shape)
    build.__qualname__ = f"LoopNet[{shape}]"
    return build


SHAPES = {  # name: the Recipe fields it sets
    "accumulate": dict(accumulation_steps=3),
    "accumulate_no_sync": dict(accumulation_steps=3, sync_each_micro_batch=False),
    "eval_between": dict(eval_every=1),
    "frozen": dict(frozen=("embed.weight", "embed.bias")),
    "unused": dict(unused=("spare.weight", "spare.bias")),
    "tied": dict(tied=(("embed.weight", "decode.weight"),)),
}
BODY = ("body.0.weight", "body.0.bias", "body.2.weight", "body.2.bias")
SCHEDULES = {  # name: the Recipe fields it sets
    "unfreeze": dict(frozen=BODY, requires_grad_at=((1, BODY, True),)),
    "unfreeze_after_eval": dict(frozen=BODY, requires_grad_at=((1, BODY, True),), eval_every=1),
    "freeze": dict(requires_grad_at=((1, BODY, False),)),
}
STEPS = 2  # steps per cell: the second runs on what the first step left (held gradients, state)
BUILDS = {shape: _builder(shape) for shape in (*SHAPES, *SCHEDULES, "plain")}  # one object per shape: shared references match
UNITS = ("body",)

PRECISIONS = {  # name: (policy, the capability it needs)
    "fp32": (None, None),
    "bf16": (MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32), "mixed_precision_bf16"),
    "fp16": (MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32), "mixed_precision_fp16"),
    # gradients kept in bfloat16 after a bfloat16 reduction: accumulation and the norm in low precision
    "bf16_lowgrads": (MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                                     keep_low_precision_grads=True), "keep_low_precision_grads"),
}


def batches(ctx, shape: str) -> list:
    """Per step: one (x, y), or the list of `accumulation_steps` of them; different per rank."""
    k = {**SHAPES, **SCHEDULES}.get(shape, {}).get("accumulation_steps", 1)
    out = []
    for step in range(STEPS):
        micro = []
        for j in range(k):
            with ctx.seeded(1000 * step + 100 * j + ctx.rank):
                micro.append((torch.randn(4, 6, device=ctx.device), torch.randn(4, 1, device=ctx.device)))
        out.append(micro if k > 1 else micro[0])
    return out
