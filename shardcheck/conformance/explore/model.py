"""What a rank builds from a drawn Config: the model, the shard spec, the recipe, its batches.

Everything is deterministic in the Config (the model is built under `ctx.seeded(0)` by
`train_in_parity`; batch i of rank r is seeded by (data_seed, i, r)), so every rank, the unsharded
reference and a replay build the same thing.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardcheck.conformance.explore.config import Config
from shardcheck.conformance.protocol import Clip, LossScale, MixedPrecision, Optimizer, Recipe, ShardSpec

TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class Block(nn.Module):
    """Linear(n_in, n_out) (+ a buffer added to its output). `forward(x, poison)` also returns
    poison * weight[0, 0]: a loss term whose only gradient is `poison` on that one weight."""

    def __init__(self, n_in: int, n_out: int, bias: bool, buffer: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(n_in, n_out, bias=bias)
        if buffer:
            self.register_buffer("shift", torch.linspace(-0.25, 0.25, n_out))

    def forward(self, x: torch.Tensor, poison: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.lin(x)
        if hasattr(self, "shift"):
            y = y + self.shift.to(y.dtype)
        return y, poison.to(y.dtype) * self.lin.weight[0, 0]


class ExploreModel(nn.Module):
    """The blocks of `config`, tanh between them; the last block's weight tied to the first's when
    `config.tied`; the parameters of `config.frozen` blocks do not require gradients."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        w = config.widths
        self.blocks = nn.ModuleList(Block(w[i], w[i + 1], config.bias[i], i in config.buffers)
                                    for i in range(config.depth))
        if config.tied:
            self.blocks[-1].lin.weight = self.blocks[0].lin.weight
        for i in config.frozen:
            self.blocks[i].requires_grad_(False)

    def forward(self, x: torch.Tensor, poison: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        extra = torch.zeros((), device=x.device)
        for i, block in enumerate(self.blocks):
            x, term = block(x, poison[i])
            extra = extra + term.float()
            if i < len(self.blocks) - 1:
                x = torch.tanh(x)
        return x, extra


def build(config: Config):
    """A zero-argument builder of the model (train_in_parity calls it under a fixed seed)."""
    return lambda: ExploreModel(config)


def loss_fn(grad_scale: float):
    """This rank's mean-squared error times `grad_scale` (gradient magnitude), plus the poison term."""
    def loss(model, batch) -> torch.Tensor:
        x, y, poison = batch
        out, extra = model(x, poison)
        return F.mse_loss(out.float(), y) * grad_scale + extra
    return loss


def batches(ctx, config: Config) -> list:
    """Rank ctx.rank's (x, y, poison) for every step (a list of `config.accumulation` of them when it
    is > 1; micro-batch 0 is the step's batch without accumulation); poison is zero but on the
    poisoned rank and step (its first micro-batch)."""
    out = []
    for step in range(config.steps):
        micro = []
        for j in range(config.accumulation):
            with ctx.seeded(100_003 * config.data_seed + 1000 * step + 100 * j + ctx.rank):
                x = torch.randn(config.batch, config.widths[0], device=ctx.device)
                y = torch.randn(config.batch, config.widths[-1], device=ctx.device)
            poison = torch.zeros(config.depth, device=ctx.device)
            p = config.poison
            if p is not None and p.step == step and p.rank == ctx.rank and j == 0:
                poison[p.block] = math.inf if p.value == "inf" else math.nan
            micro.append((x, y, poison))
        out.append(micro if config.accumulation > 1 else micro[0])
    return out


def spec(ctx, config: Config) -> ShardSpec:
    """The ShardSpec: root strategy, blocks as units with their strategies, dtypes, the mesh."""
    paths = {i: f"blocks.{i}" for i, _ in config.units}
    overrides = {paths[i]: s for i, s in config.units if s != config.strategy}
    mp = None
    if config.param_dtype != "fp32" or config.reduce_dtype != "fp32":
        mp = MixedPrecision(param_dtype=None if config.param_dtype == "fp32" else TORCH_DTYPES[config.param_dtype],
                            reduce_dtype=TORCH_DTYPES[config.reduce_dtype])
    mesh = ctx.mesh(config.mesh, ("replicate", "shard")) if config.mesh else ctx.mesh()
    return ShardSpec(strategy=config.strategy, units=tuple(paths.values()), unit_strategies=overrides,
                     mixed_precision=mp, mesh=mesh)


def recipe(config: Config) -> Recipe:
    """The optimizer, clipping and loss scaling of `config`; its frozen and tied parameters by name."""
    kwargs = {"momentum": config.momentum} if config.optimizer == "sgd" else {}
    optimizer = Optimizer(config.optimizer, lr=config.lr, weight_decay=config.weight_decay, **kwargs)
    clip = Clip(config.max_norm, config.norm_type) if config.max_norm is not None else None
    scaling = None
    if config.loss_scale is not None:
        scaling = LossScale(init_scale=config.loss_scale, growth_interval=config.growth_interval)
    frozen = tuple(f"blocks.{i}.lin.{name}" for i in sorted(config.frozen)
                   for name in ("weight", "bias") if name == "weight" or config.bias[i])
    tied = (("blocks.0.lin.weight", f"blocks.{config.depth - 1}.lin.weight"),) if config.tied else ()
    return Recipe(loss_fn=loss_fn(config.grad_scale), optimizer=optimizer, clip=clip, loss_scale=scaling,
                  frozen=frozen, tied=tied, accumulation_steps=config.accumulation,
                  sync_each_micro_batch=config.sync_each, eval_every=config.eval_every)


def tolerance_dtype(config: Config) -> torch.dtype | None:
    """The dtype whose tolerance applies: the least precise of the compute and reduce dtypes."""
    low = [d for d in ("bf16", "fp16") if d in (config.param_dtype, config.reduce_dtype)]
    return TORCH_DTYPES[low[0]] if low else None
