"""The loop's knobs (family training_loop; issue 60): a token-weighted loss over padded micro-batches
of varying length, and FSDP2's accumulation flags.

A token-weighted loss (Recipe.tokens, capability `token_weighted_loss`) is what users of causal
language models write: the sum of the cross-entropy over the step's non-pad targets divided by
their global number, counted over every rank's micro-batches and agreed before the first backward,
the engine's average over the ranks undone, or the gradients summed (a gradient divide factor of 1,
as torchtitan sets FSDP2's: `test_token_weighted_loss_summed`) (docs/models.md). Averaging each micro-batch's own
mean instead is the bug transformers' Trainer had for years. Each cell (FULL_SHARD with gradients
synced on every micro-batch or the last only, NO_SHARD and SHARD_OPTIMIZER the last only) trains TokenLM
(checks/support/knobs.py) two steps of three micro-batches per rank, two sequences of 1 to 9 tokens
each, and compares every micro-batch's share of the loss, the gradients and the parameters with one
device training on the step's tokens of all ranks in one batch (knobs.OneBatchReference): no
average, no all-reduce on the yardstick's side. SGD with momentum, so that a wrong weighting moves
the parameters as well as the gradients.

FSDP2's flags, set before each micro-batch as torch's own test_fully_shard_training.py
(test_gradient_accumulation, test_1f1b_microbatching) sets them: `set_requires_gradient_sync(last)`
(the capability `no_sync`), `set_reshard_after_backward(last)` (`reshard_after_backward`) and
`set_is_last_backward(last)` (`is_last_backward`). Each cell trains LoopNet two steps of three
micro-batches under SHARD_GRAD_OP (torch's test keeps parameters unsharded after backward only with
reshard_after_forward=False), in parity with unsharded data-parallel training, and watches each
micro-batch's collectives (knobs.CollectiveWatch): no gradient reduced while sync is off, gradients
reduced whenever it is on (a backward marked not the last included), no parameter gathered again
after a backward that kept them, and the update gathered afresh at the next step. torch-fsdp1 reaches
the `reshard_after_backward` cells through its own equivalent (SHARD_GRAD_OP inside no_sync() keeps
the parameters unsharded by itself), the reference through reference_impl's `set_reshard_after_backward`.
"""

from __future__ import annotations

from typing import Any

import pytest

from shardcheck.conformance.checks.support import knobs, loops
from shardcheck.conformance.checks.support.parity import train_in_parity
from shardcheck.conformance.protocol import Clip, Optimizer, Recipe, ShardSpec
from shardcheck.conformance.protocol.capabilities import of_loop, of_strategy
from shardcheck.harness import distributed

MICRO_BATCHES, STEPS = 3, 2
TOKEN_RECIPES = {sync: Recipe(loss_fn=knobs.summed_loss, optimizer=Optimizer("sgd", lr=0.1, momentum=0.9),
                              accumulation_steps=MICRO_BATCHES, sync_each_micro_batch=sync == "every",
                              tokens=knobs.target_tokens)
                 for sync in ("every", "last")}
# FULL_SHARD with gradients synced on every micro-batch and on the last only, the replicated strategies on
# the last only: the knobs' cells stay near 10 CPU-seconds of the default run (docs/models.md)
TOKEN_CELLS = [("FULL_SHARD", "every"), ("FULL_SHARD", "last"), ("NO_SHARD", "last"), ("SHARD_OPTIMIZER", "last")]
FLAGS: dict[str, dict[str, Any]] = {  # the Recipe fields each cell sets
    "reshard_after_backward": dict(sync_each_micro_batch=False, reshard_after_backward=False),
    "last_backward": dict(mark_last_backward=True),  # sync on every micro-batch: each one still reduces
    "torch_pattern": dict(sync_each_micro_batch=False, reshard_after_backward=False, mark_last_backward=True),
}
FLAG_RECIPES = {name: Recipe(loss_fn=loops.loss_fn, optimizer=Optimizer("adam", lr=1e-2), clip=Clip(0.5, 2.0),
                             accumulation_steps=MICRO_BATCHES, **fields) for name, fields in FLAGS.items()}


def _token_needs(params) -> set[str]:
    return {of_strategy(params["strategy"])} | of_loop(TOKEN_RECIPES[params["sync"]])


def _flag_needs(params) -> set[str]:
    return {of_strategy(params["strategy"]), "clip_norm_2"} | of_loop(FLAG_RECIPES[params["flags"]])


@distributed(world_size=[2, 4])
@pytest.mark.requires.with_args(_token_needs)
@pytest.mark.parametrize("strategy,sync", TOKEN_CELLS)
def test_token_weighted_loss(ctx, impl, strategy, sync):
    """The step's loss is the mean over every rank's non-pad targets: each micro-batch's share of it,
    the gradients and the parameters match one device training on those tokens in one batch, with
    gradients synced on every micro-batch or on the last only."""
    spec = ShardSpec(strategy=strategy, units=knobs.UNITS, mesh=ctx.mesh())
    knobs.train_token_weighted(ctx, impl, spec, TOKEN_RECIPES[sync], STEPS)


@distributed(world_size=[2, 4])
@pytest.mark.requires.with_args(lambda params: _token_needs(dict(params, sync="last")) | {"gradient_divide_factor"})
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
def test_token_weighted_loss_summed(ctx, impl, strategy):
    """The same loss with the gradients summed over the ranks instead of averaged (gradient divide
    factor 1, as torchtitan sets FSDP2's): the loss divided by the global count alone, with no
    world-size correction, gives the same global token mean."""
    spec = ShardSpec(strategy=strategy, units=knobs.UNITS, mesh=ctx.mesh(), gradient_divide_factor=1.0)
    knobs.train_token_weighted(ctx, impl, spec, TOKEN_RECIPES["last"], STEPS)


@distributed(world_size=[2, 4])
@pytest.mark.requires.with_args(_flag_needs)
@pytest.mark.parametrize("flags", sorted(FLAGS))
@pytest.mark.parametrize("strategy", ["SHARD_GRAD_OP"])
def test_accumulation_flags(ctx, impl, strategy, flags):
    """FSDP2's accumulation flags set before each micro-batch: parity with unsharded training, and
    each micro-batch's collectives as the flags promise (module doc)."""
    spec = ShardSpec(strategy=strategy, units=loops.UNITS, mesh=ctx.mesh())
    train_in_parity(ctx, impl, loops.BUILDS["plain"], spec, FLAG_RECIPES[flags], loops.batches(ctx, "accumulate"),
                    watch=knobs.CollectiveWatch)
