"""Real models (family models): the architectures users shard, as transformers builds them
(checks/support/zoo.py: Llama with grouped-query attention, tied and untied; GPT-2's Conv1D; a
Mixtral mixture of experts with its router's auxiliary loss), each wrapped per decoder layer as the
recipes wrap it, train exactly as unsharded data-parallel training does: three steps of AdamW with
the gradients clipped by their 2-norm, the loss, the full averaged gradients, the total norm and the
parameters compared after every step (checks/support/parity.py), for each sharding strategy.

`shardcheck run --model pkg.module:factory` judges the user's own model in the same cells, instead
of the zoo (checks/support/own_model.py).
"""

from __future__ import annotations

import pytest

from shardcheck.conformance.checks.support import own_model, zoo
from shardcheck.conformance.checks.support.parity import train_in_parity
from shardcheck.conformance.protocol import Clip, Optimizer, Recipe, ShardSpec
from shardcheck.conformance.protocol.capabilities import of_norm, of_strategy
from shardcheck.harness import distributed

STEPS = 3
CLIP = Clip(1.0, 2.0)  # below the first steps' total norms of every architecture: clipping is active
OPTIMIZER = Optimizer("adamw", lr=1e-3)
STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "SHARD_OPTIMIZER"]


def _needs(params) -> set[str]:
    return {of_strategy(params["strategy"]), of_norm(CLIP.norm_type)}


def pytest_generate_tests(metafunc):
    if "model_name" in metafunc.fixturenames:
        own = own_model.names(metafunc.config)  # given, the family judges them alone
        missing = pytest.mark.skipif(not zoo.available(), reason=zoo.MISSING)  # this machine's, not the engine's
        metafunc.parametrize("model_name", own or [pytest.param(name, marks=missing) for name in sorted(zoo.ARCHS)])


@distributed(world_size=[2, 4])
@pytest.mark.requires.with_args(_needs)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_model_parity(ctx, impl, strategy, model_name):
    """Three steps of AdamW, clipped by norm 2, per decoder-layer units: loss, gradients, norm and
    parameters match unsharded data-parallel training after every step."""
    own = own_model.is_own(model_name)
    workload = own_model.workload(model_name) if own else zoo.WORKLOADS[model_name]
    recipe = Recipe(loss_fn=workload.loss_fn, optimizer=OPTIMIZER, clip=CLIP)
    spec = ShardSpec(strategy=strategy, units=workload.units, mesh=ctx.mesh())
    results = train_in_parity(ctx, impl, workload.build, spec, recipe, workload.batches(ctx, STEPS))
    ctx.record("clipped", results[0].total_norm > CLIP.max_norm)
    if not own:  # not vacuous: clipping changed the first step (a user's model may have smaller gradients)
        assert results[0].total_norm > CLIP.max_norm, f"total norm {results[0].total_norm} <= max_norm: nothing clipped"

