"""Training parity (family train_parity): a sharded trainer computes, step by step, exactly what
unsharded data-parallel training computes (seeds 000 and 003: `_test_ddp_parity`, the clip loops).

For each sharding strategy (mapped by the implementation to its nearest equivalent), each clip norm
type and two models (uneven/empty shards; the seeds' NestedWrappedModule), four steps of Adam; after
each step the loss, the full averaged gradients, the total norm and the full parameters must match
the unsharded reference (checks/support/parity.py). The candidate performs the step its own way.
"""

from __future__ import annotations

import math

import pytest

from shardcheck.conformance.checks.support.parity import train_in_parity
from shardcheck.conformance.checks.support.workloads import WORKLOADS
from shardcheck.conformance.protocol import Clip, Optimizer, Recipe, ShardSpec
from shardcheck.conformance.protocol.capabilities import of_norm, of_strategy
from shardcheck.harness import distributed

STEPS = 4
MAX_NORM = 0.05  # below every first-step total norm of both workloads: clipping is active


def _needs(params) -> set[str]:
    needed = {of_strategy(params["strategy"])}
    if params.get("norm_type") is not None:
        needed.add(of_norm(params["norm_type"]))
    return needed


def _mesh(ctx, strategy):
    return ctx.mesh((2, ctx.world_size // 2), ("replicate", "shard")) if strategy == "HYBRID_SHARD" else ctx.mesh()


def _parity(ctx, impl, strategy, norm_type, workload, optimizer=Optimizer("adam", lr=1e-2)):
    w = WORKLOADS[workload]
    clip = Clip(MAX_NORM, norm_type) if norm_type is not None else None
    recipe = Recipe(loss_fn=w.loss_fn, optimizer=optimizer, clip=clip)
    spec = ShardSpec(strategy=strategy, units=w.units, mesh=_mesh(ctx, strategy))
    results = train_in_parity(ctx, impl, w.build, spec, recipe, w.batches(ctx, STEPS))
    if clip is not None:  # not vacuous: clipping changed at least the first step
        assert results[0].total_norm > MAX_NORM, f"total norm {results[0].total_norm} <= max_norm"


@distributed(world_size=[2, 4])
@pytest.mark.requires.with_args(_needs)
@pytest.mark.parametrize("workload", sorted(WORKLOADS))
@pytest.mark.parametrize("norm_type", [None, 1.0, 2.0, math.inf], ids=["noclip", "norm1", "norm2", "norminf"])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "SHARD_OPTIMIZER"])
def test_train_parity(ctx, impl, strategy, norm_type, workload):
    """Adam, clipping by norm_type (or none), 4 steps: loss, gradients, norm, parameters match."""
    _parity(ctx, impl, strategy, norm_type, workload)


@distributed(world_size=4)
@pytest.mark.requires.with_args(_needs)
@pytest.mark.parametrize("workload", sorted(WORKLOADS))
@pytest.mark.parametrize("norm_type", [None, 1.0, 2.0, math.inf], ids=["noclip", "norm1", "norm2", "norminf"])
@pytest.mark.parametrize("strategy", ["HYBRID_SHARD"])
def test_train_parity_hybrid(ctx, impl, strategy, norm_type, workload):
    """HYBRID_SHARD on a (replicate=2, shard=2) mesh: the same parity as a 1-D strategy."""
    _parity(ctx, impl, strategy, norm_type, workload)


@distributed(world_size=[2, 4])
@pytest.mark.requires.with_args(lambda params: _needs(params) | {"clip_norm_2"})
@pytest.mark.parametrize("optimizer", [Optimizer("sgd", lr=0.05, momentum=0.9, weight_decay=0.01),
                                       Optimizer("adamw", lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1)],
                         ids=["sgd_momentum_wd", "adamw_wd"])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD", "SHARD_OPTIMIZER"])
def test_optimizer_parity(ctx, impl, strategy, optimizer):
    """The optimizer's hyper-parameters are honoured exactly (momentum, betas, weight decay)."""
    _parity(ctx, impl, strategy, 2.0, "uneven_mlp", optimizer)
