"""Mixed precision (family mixed_precision), from seeds 001 and 002 (fp16 parity with the grad
scaler; bf16 MixedPrecisionPolicy training): compute in a low-precision dtype with float32 master
parameters and float32 gradient reduction, compared step by step with unsharded data-parallel
training doing the same (checks/support/dp_reference.py). Then where real models cross the
contract (checks/support/policies.py): a policy per unit, and floating buffers under buffer_dtype,
with the dtype contract watched at every boundary (checks/support/dtype_contract.py).

Both sides compute the same low-precision forward and backward on the same values, and reduce in
float32, so they differ only by the order of float32 sums: the float32 tolerance applies to the
gradients and parameters. The loss is compared at the compute dtype's tolerance.
"""

from __future__ import annotations

import pytest
import torch

from shardcheck.conformance.checks.support import policies
from shardcheck.conformance.checks.support.dtype_contract import Watch
from shardcheck.conformance.checks.support.parity import train_in_parity
from shardcheck.conformance.checks.support.workloads import WORKLOADS
from shardcheck.conformance.protocol import Clip, MixedPrecision, Optimizer, Recipe, ShardSpec
from shardcheck.conformance.protocol.capabilities import of_strategy
from shardcheck.harness import distributed

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@distributed(world_size=[2, 4])
@pytest.mark.requires.with_args(lambda params: {of_strategy(params["strategy"]), "clip_norm_2",
                                                f"mixed_precision_{params['dtype']}"})
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "SHARD_OPTIMIZER"])
def test_low_precision_compute(ctx, impl, strategy, dtype):
    w = WORKLOADS["uneven_mlp"]
    recipe = Recipe(loss_fn=w.loss_fn, optimizer=Optimizer("adam", lr=1e-2), clip=Clip(0.5, 2.0))
    spec = ShardSpec(strategy=strategy, units=w.units, mesh=ctx.mesh(),
                     mixed_precision=MixedPrecision(param_dtype=DTYPES[dtype], reduce_dtype=torch.float32))
    train_in_parity(ctx, impl, w.build, spec, recipe, w.batches(ctx, 3))


def _layout_needs(params) -> set[str]:
    *_, needs = policies.LAYOUTS[params["layout"]]
    return {of_strategy(params["strategy"]), "clip_norm_2", "mixed_precision_bf16", *needs}


def _train_layout(ctx, impl, layout, strategy):
    build, units, root, per_unit, _ = policies.LAYOUTS[layout]
    spec = ShardSpec(strategy=strategy, units=units, mesh=ctx.mesh(), mixed_precision=root,
                     unit_mixed_precision=per_unit)
    recipe = Recipe(loss_fn=policies.loss_fn, optimizer=Optimizer("adam", lr=1e-2), clip=Clip(0.5, 2.0))
    train_in_parity(ctx, impl, build, spec, recipe, policies.batches(ctx), watch=Watch)


@distributed(world_size=[2, 4])
@pytest.mark.requires.with_args(_layout_needs)
@pytest.mark.parametrize("layout", ["float32_inside", "low_inside"])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD", "SHARD_OPTIMIZER"])
def test_per_unit_policies(ctx, impl, strategy, layout):
    """A policy per unit (a float32 norm and head among bfloat16 units, and the reverse): each unit
    casts the activation it receives to its own dtype and the activation keeps its gradient
    (pytorch#90921 lost it in a cast under no_grad); the numbers equal unsharded training under the
    same per-module dtypes, and the dtype contract names the first boundary crossed wrongly."""
    _train_layout(ctx, impl, layout, strategy)


@distributed(world_size=2)
@pytest.mark.requires.with_args(_layout_needs)
@pytest.mark.parametrize("layout", ["buffer_dtype", "own_dtype"])
@pytest.mark.parametrize("strategy", ["FULL_SHARD"])
def test_buffer_dtype(ctx, impl, strategy, layout):
    """Floating buffers (BatchNorm's running statistics, updated in forward, and a registered
    constant) are in `buffer_dtype` when the policy sets it (pytorch#143900: ignored), and stay as
    built when it does not; the constant's dtype decides the output's, so the numbers show it too."""
    _train_layout(ctx, impl, layout, strategy)
