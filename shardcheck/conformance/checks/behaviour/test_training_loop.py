"""The loop users actually run (family training_loop): gradient accumulation with gradients synced
on every micro-batch or on the last only, an evaluation forward between steps (the first forward
of all without gradients), frozen, unused and tied parameters; in float32 and under each mixed
precision policy. From seeds 000 and 003 (`_test_ddp_parity`: the same model trained by FSDP and
by DDP, compared after every step), with the loop's shape as the recipe's data (spec.Recipe).

Each cell trains `LoopNet` (checks/support/loops.py) two or three steps of Adam with clipping by
the 2-norm, compared after every micro-batch and step with unsharded data-parallel training doing
the same loop (checks/support/dp_reference.py). Under mixed precision the suite's own hooks watch
the dtype contract at every boundary as observed facts (checks/support/dtype_contract.py): the
parameters and inputs a module's forward sees, an input cast that loses its gradient, the dtype
each gradient reduction and each norm reduction travels in, and reductions that no_sync should
have suppressed. A broken boundary fails the cell with one line naming it, before the numbers.
"""

from __future__ import annotations

import pytest

from shardcheck.conformance.checks.support import loops
from shardcheck.conformance.checks.support.dtype_contract import Watch
from shardcheck.conformance.checks.support.parity import train_in_parity
from shardcheck.conformance.protocol import Clip, Optimizer, Recipe, ShardSpec
from shardcheck.conformance.protocol.capabilities import of_loop, of_strategy
from shardcheck.harness import distributed

RECIPES = {shape: Recipe(loss_fn=loops.loss_fn, optimizer=Optimizer("adam", lr=1e-2), clip=Clip(0.5, 2.0), **fields)
           for shape, fields in {**loops.SHAPES, **loops.SCHEDULES}.items()}
# keep_low_precision_grads: one plain step of SGD (torch's Adam wants gradients in the parameters'
# dtype; bfloat16 gradients summed over micro-batches in another order differ by an ulp of the sum)
LOWGRADS = Recipe(loss_fn=loops.loss_fn, optimizer=Optimizer("sgd", lr=0.05), clip=Clip(0.5, 2.0))


def _needs(params) -> set[str]:
    recipe = LOWGRADS if params["precision"] == "bf16_lowgrads" else RECIPES[params["shape"]]
    needed = {of_strategy(params["strategy"]), "clip_norm_2"} | of_loop(recipe)
    capability = loops.PRECISIONS[params["precision"]][1]
    return needed | ({capability} if capability else set())


def _loop(ctx, impl, shape, strategy, precision, recipe, steps=None):
    """`steps` of `recipe` on LoopNet[shape] in parity with unsharded training, the dtype contract
    watched. Tolerance: float32's (both sides compute the same low-precision values and reduce in
    float32), bfloat16's where the gradients themselves stay bfloat16."""
    policy = loops.PRECISIONS[precision][0]
    spec = ShardSpec(strategy=strategy, units=loops.UNITS, mesh=ctx.mesh(), mixed_precision=policy)
    dtype = policy.param_dtype if policy is not None and policy.keep_low_precision_grads else None
    train_in_parity(ctx, impl, loops.BUILDS[shape], spec, recipe, loops.batches(ctx, shape)[:steps], dtype=dtype,
                    watch=Watch)


@distributed(world_size=[2, 4])
@pytest.mark.requires.with_args(_needs)
@pytest.mark.parametrize("precision", ["fp32"])
@pytest.mark.parametrize("shape", sorted(loops.SHAPES))
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "SHARD_OPTIMIZER"])
def test_training_loop(ctx, impl, strategy, shape, precision):
    """Each loop shape x strategy in float32: every micro-batch's loss, the accumulated gradients,
    the norm and the parameters match unsharded data-parallel training; no_sync sends nothing
    before the last micro-batch."""
    _loop(ctx, impl, shape, strategy, precision, RECIPES[shape])


@distributed(world_size=2)  # the shards' layout is float32's business: world size 4 adds time, not cases
@pytest.mark.requires.with_args(_needs)
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("shape", sorted(loops.SHAPES))
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "SHARD_OPTIMIZER"])
def test_training_loop_mixed_precision(ctx, impl, strategy, shape, precision):
    """Each loop shape x strategy under each mixed-precision policy (float32 reduction): the same
    parity, and the dtype contract observed at every boundary (forward parameters and inputs, the
    input cast's gradient, the reduction's dtype, the norm's dtype)."""
    _loop(ctx, impl, shape, strategy, precision, RECIPES[shape])


@distributed(world_size=2)  # two ranks' bfloat16 sum is one addition: at 4 its order is the backend's
@pytest.mark.requires.with_args(_needs)
@pytest.mark.parametrize("precision", ["bf16_lowgrads"])
@pytest.mark.parametrize("shape", ["plain"])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD", "SHARD_OPTIMIZER"])
def test_low_precision_grads_norm(ctx, impl, strategy, shape, precision):
    """Gradients kept in bfloat16 (keep_low_precision_grads) and clipped: one step compared at
    bfloat16's tolerance (the yardstick's gradients are float32 copies of the same values); the norm
    must still be computed and reduced in float32, whatever the gradients' dtype."""
    _loop(ctx, impl, shape, strategy, precision, LOWGRADS, steps=1)


@distributed(world_size=2)
@pytest.mark.requires.with_args(_needs)
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("shape", sorted(loops.SCHEDULES))
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD", "SHARD_OPTIMIZER"])
def test_requires_grad_changes(ctx, impl, strategy, shape, precision):
    """A fine-tuning schedule: a unit frozen for the first step (with and without an evaluation
    before it) then unfrozen, or trained then frozen; in float32 and under each mixed-precision
    policy. Engines resolve hooks and dtypes lazily at the first forward: a unit whose first
    forwards had nothing to train must reduce in reduce_dtype once it trains (pytorch#186998), and
    train at all. The same parity and dtype contract as every loop cell."""
    _loop(ctx, impl, shape, strategy, precision, RECIPES[shape])
