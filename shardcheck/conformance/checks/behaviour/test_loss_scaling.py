"""Dynamic loss scaling (family loss_scaling), from seed 001 (`test_sharded_grad_scaler_found_inf`,
the parity loop of `test_fsdp_ddp_parity_with_grad_scaler`): an inf or NaN in ONE rank's gradient
makes EVERY rank skip the step and back off the scale; finite steps grow it after the interval.

The poison reaches only the head bias's gradient on rank 1 (checks/support/workloads.py): with a
sharded gradient only the rank holding that shard sees it, so the decision must be agreed across
ranks. Steps: 0 finite, 1 poisoned, 2 and 3 finite (growth_interval 2: the scale grows at step 3),
4 poisoned again. The candidate's loss, gradients, skip decisions, scales and parameters must match
unsharded data-parallel training with torch.amp.GradScaler.
"""

from __future__ import annotations

import math

import pytest

from shardcheck.conformance.checks.support.parity import train_in_parity
from shardcheck.conformance.checks.support.workloads import WORKLOADS
from shardcheck.conformance.protocol import Clip, LossScale, Optimizer, Recipe, ShardSpec
from shardcheck.conformance.protocol.capabilities import of_strategy
from shardcheck.harness import distributed

POISONED = (1, 4)


@distributed(world_size=[2, 4])
@pytest.mark.requires.with_args(lambda params: {of_strategy(params["strategy"]), "loss_scaling", "clip_norm_2"})
@pytest.mark.parametrize("poison", [math.inf, math.nan], ids=["inf", "nan"])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "SHARD_OPTIMIZER"])
def test_skip_backoff_growth(ctx, impl, strategy, poison):
    w = WORKLOADS["uneven_mlp"]
    scaling = LossScale(init_scale=2.0 ** 10, growth_factor=2.0, backoff_factor=0.5, growth_interval=2)
    recipe = Recipe(loss_fn=w.loss_fn, optimizer=Optimizer("adam", lr=1e-2), clip=Clip(1.0, 2.0),
                    loss_scale=scaling)
    spec = ShardSpec(strategy=strategy, units=w.units, mesh=ctx.mesh())
    batches = w.batches(ctx, 5, poison={step: poison for step in POISONED})
    results = train_in_parity(ctx, impl, w.build, spec, recipe, batches)
    # The reference itself must show the behaviour, or the comparison proves nothing.
    assert [r.skipped for r in results] == [False, True, False, False, True], results
    assert [r.scale for r in results] == [2.0 ** 10, 2.0 ** 9, 2.0 ** 9, 2.0 ** 10, 2.0 ** 9], results
