"""Sharding (family sharding): a strategy does for a rank's memory and traffic what it promises,
measured by the suite around the engine's own training step, never taken from the adapter's word.

Numbers alone cannot tell sharding from replication: an engine that keeps every parameter, gradient
and optimizer moment on every rank trains exactly like unsharded data parallelism. So each cell
trains the same model two steps twice on every rank, once with the candidate's trainer and once
unsharded (checks/support/dp_reference.py), both under the suite's instruments
(shardcheck/conformance/measure/: storage bytes by kind at the allocations, collectives at the dispatcher), and
judges the candidate's last step against the strategy's promise (shardcheck/conformance/measure/promises.py),
with bounds computed from the model's shapes: bytes held between steps, optimizer state and
gradients (wherever the engine keeps them) shrink as 1/n, FULL_SHARD keeps no more than its root and
one unit gathered after forward and gathers a few units at a time, the step's peak stays within what
its parts need, and each collective kind sends what the strategy's design formula says. One rank and
NO_SHARD are judged against unsharded training; SHARD_OPTIMIZER (ZeRO-1) keeps parameters and
gradients whole, its optimizer state 1/n, and sends one gradient all-reduce and a parameter
redistribution. Every figure lands in the report
(`ctx.record("footprint", ...)`), whether the cell passes or not.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from shardcheck.conformance.checks.support import shared_reference
from shardcheck.conformance.checks.support.dp_reference import DataParallelReference
from shardcheck.conformance.measure import footprint, promises
from shardcheck.conformance.protocol import Optimizer, Recipe, ShardSpec
from shardcheck.conformance.protocol.capabilities import of_strategy
from shardcheck.harness import distributed

STEPS = 2  # the first step allocates the optimizer's state; the second is measured
WIDTH, BLOCKS = 64, 8


class StackedBlocks(nn.Module):
    """`BLOCKS` equal Linear(64, 64) + ReLU units and a small head in the root (0.8% of the
    parameters): what a unit gathers is an equal eighth, so "one unit at a time" and "all at once"
    differ eightfold, and the root keeps almost nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(BLOCKS))
        self.head = nn.Linear(WIDTH, 4)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _loss(model, batch):
    x, y = batch
    return F.mse_loss(model(x).float(), y)


RECIPE = Recipe(loss_fn=_loss, optimizer=Optimizer("adam", lr=1e-2))
UNITS = tuple(f"blocks.{i}" for i in range(BLOCKS))


def _batches(ctx) -> list:
    out = []
    for step in range(STEPS):
        with ctx.seeded(1000 * step + ctx.rank):
            out.append((torch.randn(4, WIDTH, device=ctx.device), torch.randn(4, 4, device=ctx.device)))
    return out


def _unsharded(ctx) -> dict:
    """The yardstick's footprint on this rank: the whole model and optimizer, gradients all-reduced."""
    spec = ShardSpec(strategy="NO_SHARD", mesh=None)
    return footprint.measure(ctx, StackedBlocks, lambda model, recipe: DataParallelReference(
        model, spec, recipe, ctx.group), RECIPE, _batches(ctx))


def _sharded(ctx, impl, strategy) -> tuple[int, int, dict]:
    if strategy == "HYBRID_SHARD":
        mesh, n, r = ctx.mesh((2, ctx.world_size // 2), ("replicate", "shard")), ctx.world_size // 2, 2
    else:
        mesh, n, r = ctx.mesh(), ctx.world_size, 1  # SHARD_OPTIMIZER: the optimizer state over the world
    if strategy == "NO_SHARD":
        n, r = 1, ctx.world_size  # replicated: no memory promise; traffic over the whole world
    spec = ShardSpec(strategy=strategy, units=UNITS, mesh=mesh)
    measured = footprint.measure(ctx, StackedBlocks, lambda model, recipe: impl.trainer(model, spec, recipe),
                                 RECIPE, _batches(ctx))
    return n, r, measured


def _judge(ctx, impl, strategy):
    if ctx.is_threaded:
        pytest.skip("thread-mode ranks share one process: memory and traffic per rank are measured on a "
                    "process backend (gloo, nccl)")
    n, r, measured = _sharded(ctx, impl, strategy)
    unsharded = shared_reference.computed_once(ctx, _unsharded)
    shapes = promises.Shapes.of(StackedBlocks(), UNITS, n)
    failures, figures = promises.judge(strategy, n, r, measured, unsharded, shapes)
    ctx.record("footprint", figures)
    assert figures["rows"], f"no promise of {strategy} applies at shard size {n}: the cell would assert nothing"
    assert not failures, "; ".join(failures)


@distributed(world_size=[1, 2, 4])
@pytest.mark.requires.with_args(lambda params: {of_strategy(params["strategy"])})
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "SHARD_OPTIMIZER"])
def test_sharding(ctx, impl, strategy):
    """Memory held, gathered and sent per rank, against the strategy's promise."""
    _judge(ctx, impl, strategy)


@distributed(world_size=4)
@pytest.mark.requires("hybrid_shard")
def test_sharding_hybrid(ctx, impl):
    """HYBRID_SHARD on a (replicate=2, shard=2) mesh: FULL_SHARD's promise within a shard group."""
    _judge(ctx, impl, "HYBRID_SHARD")
