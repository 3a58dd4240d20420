"""Training parity with a user-set gradient divide factor (family train_parity; issue 60's knob).

`ShardSpec.gradient_divide_factor` d (capability `gradient_divide_factor`): the reduced gradient is
the sum over every data-parallel rank divided by d instead of by their number, as FSDP2's
`set_gradient_divide_factor` promises and torchtitan relies on (it sets it on routed experts so that
their gradients are divided as the dense layers' are). On a 2-D (replicate, shard) mesh the factor
divides the sum over BOTH dimensions once: FSDP2 reduce-scatters with a 1/d pre-multiplied sum and
all-reduces across replicas with a plain sum (_fsdp_collectives._get_gradient_divide_factors).

The cells: d = 1 (a sum), 2 (the shard group's size on the meshes below where it is 2: FSDP2 then
averages the reduce-scatter and sums the all-reduce) and 3 (a factor that is no rank count), on a 1-D
FULL_SHARD mesh at world sizes 1, 2 and 4, and on HYBRID_SHARD meshes at world size 4 of shapes
(2, 2), (1, 4) and (4, 1): one replica, and one rank per shard group, as stacks make them whenever a
degree is configured to 1. Float32 gradients only: reduced in float16, FSDP2 splits the divisor
around its sums and a one-rank shard group divides twice (FINDINGS F71), but float16 sums in another
order than the yardstick's differ by more than float16's tolerance near zero, so no cell judges them
yet. SGD with momentum, so that a wrong divisor changes the parameters as well as the gradients (Adam
would normalize most of it away); the gradients are compared every step.
"""

from __future__ import annotations

import pytest

from shardcheck.conformance.checks.support.parity import train_in_parity
from shardcheck.conformance.checks.support.workloads import WORKLOADS
from shardcheck.conformance.protocol import Optimizer, Recipe, ShardSpec
from shardcheck.harness import distributed

STEPS = 3
FACTORS = [1.0, 2.0, 3.0]
MESHES = {"2x2": (2, 2), "1x4": (1, 4), "4x1": (4, 1)}  # (replicate, shard) at world size 4


def _parity(ctx, impl, strategy, mesh, factor):
    w = WORKLOADS["uneven_mlp"]
    recipe = Recipe(loss_fn=w.loss_fn, optimizer=Optimizer("sgd", lr=0.05, momentum=0.9))
    spec = ShardSpec(strategy=strategy, units=w.units, mesh=mesh, gradient_divide_factor=factor)
    train_in_parity(ctx, impl, w.build, spec, recipe, w.batches(ctx, STEPS))


@distributed(world_size=[1, 2, 4])
@pytest.mark.requires("gradient_divide_factor", "full_shard")
@pytest.mark.parametrize("factor", FACTORS)
def test_train_parity_divide_factor(ctx, impl, factor):
    """FULL_SHARD on a 1-D mesh: gradients are the sum over the ranks divided by `factor`."""
    _parity(ctx, impl, "FULL_SHARD", ctx.mesh(), factor)


@distributed(world_size=4)
@pytest.mark.requires("gradient_divide_factor", "hybrid_shard")
@pytest.mark.parametrize("factor", FACTORS)
@pytest.mark.parametrize("mesh", sorted(MESHES))
def test_train_parity_divide_factor_hybrid(ctx, impl, mesh, factor):
    """HYBRID_SHARD on a (replicate, shard) mesh, a dimension of size 1 included: the sum over both
    dimensions divided by `factor` once."""
    _parity(ctx, impl, "HYBRID_SHARD", ctx.mesh(MESHES[mesh], ("replicate", "shard")), factor)

