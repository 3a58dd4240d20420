"""Mixed precision (family mixed_precision), from seeds 001 and 002 (fp16 parity with the grad
scaler; bf16 MixedPrecisionPolicy training): compute in a low-precision dtype with float32 master
parameters and float32 gradient reduction, compared step by step with unsharded data-parallel
training doing the same (checks/support/dp_reference.py).

Both sides compute the same low-precision forward and backward on the same values, and reduce in
float32, so they differ only by the order of float32 sums: the float32 tolerance applies to the
gradients and parameters. The loss is compared at the compute dtype's tolerance.
"""

from __future__ import annotations

import pytest
import torch

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
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_low_precision_compute(ctx, impl, strategy, dtype):
    w = WORKLOADS["uneven_mlp"]
    recipe = Recipe(loss_fn=w.loss_fn, optimizer=Optimizer("adam", lr=1e-2), clip=Clip(0.5, 2.0))
    spec = ShardSpec(strategy=strategy, units=w.units, mesh=ctx.mesh(),
                     mixed_precision=MixedPrecision(param_dtype=DTYPES[dtype], reduce_dtype=torch.float32))
    train_in_parity(ctx, impl, w.build, spec, recipe, w.batches(ctx, 3))
