"""The loop's knobs (family training_loop; issue 60): a mixture of experts whose experts get no
tokens on some ranks in some steps (capability `idle_experts`, Recipe.routed).

The yardstick is unsharded data-parallel training, with DDP's rule for a parameter some ranks give
no gradient (find_unused_parameters=True: its reducer all-reduces the map of locally used
parameters; dp_reference.used_anywhere_): an expert used on some ranks and not on others has, on
EVERY rank, the sum of the users' gradients divided by the world size W (an expert used on rank 1
alone at world size 2: rank 1's gradient / 2), which is the gradient of the mean of the ranks'
losses; an expert no rank used in a step has a None gradient, and AdamW skips it (no weight decay,
no step by its moments), where a zero gradient would move it. Engines leave a gradient no rank has
None or zero: the gradients are compared with None as zeros there (parity.compare_steps), and the
parameters after the step, strictly, tell the two apart.

Each cell trains `RoutedNet` (checks/support/experts.py: a suite-defined top-1 mixture of four
experts, one module each, routed by the batch so that the idle expert is chosen; its docstring says
why not a transformers MoE) two steps of AdamW with weight decay, `moe` (router and experts) a unit
of its own, under FULL_SHARD (an idle expert's rows held by a rank that did not use it), NO_SHARD
(replicas that must step alike) and SHARD_OPTIMIZER (each rank steps its part of every expert), in
parity with the yardstick after every step:

    idle_on_a_rank   every expert used by some rank and idle on another, each step
    idle_everywhere  every expert used at step 0; the last one idle on every rank at step 1
"""

from __future__ import annotations

import pytest

from shardcheck.conformance.checks.support import experts
from shardcheck.conformance.checks.support.parity import train_in_parity
from shardcheck.conformance.protocol import Clip, Optimizer, Recipe, ShardSpec
from shardcheck.conformance.protocol.capabilities import of_loop, of_strategy
from shardcheck.harness import distributed

STEPS = 2
RECIPE = Recipe(loss_fn=experts.loss_fn, optimizer=Optimizer("adamw", lr=1e-2, weight_decay=0.1),
                routed=experts.ROUTED)


@distributed(world_size=[2, 4])
@pytest.mark.requires.with_args(lambda params: {of_strategy(params["strategy"])} | of_loop(RECIPE))
@pytest.mark.parametrize("routes", experts.ROUTES)
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD", "SHARD_OPTIMIZER"])
def test_idle_experts(ctx, impl, strategy, routes):
    """Experts idle on some ranks (or on all) in a step: gradients and parameters as unsharded
    data-parallel training's (module doc)."""
    spec = ShardSpec(strategy=strategy, units=experts.UNITS, mesh=ctx.mesh())
    train_in_parity(ctx, impl, experts.RoutedNet, spec, RECIPE, experts.batches(ctx, routes, STEPS))


MESH_RECIPES = {"unclipped": Recipe(loss_fn=experts.loss_fn, optimizer=Optimizer("adam", lr=1e-2)),
                "norm2": Recipe(loss_fn=experts.loss_fn, optimizer=Optimizer("adam", lr=1e-2), clip=Clip(0.5, 2.0))}


@distributed(world_size=[2, 4])
@pytest.mark.requires.with_args(lambda params: {"full_shard", "expert_mesh"} | of_loop(MESH_RECIPES[params["clip"]])
                                | ({"clip_norm_2"} if MESH_RECIPES[params["clip"]].clip else set()))
@pytest.mark.parametrize("clip", sorted(MESH_RECIPES))
def test_experts_on_their_own_mesh(ctx, impl, clip):
    """The experts sharded over a 2-D (ep, dp_shard_mod_ep) mesh of their own, (2, W/2), the rest of
    the model FULL_SHARD over all W ranks: gradients (each the mean over all W ranks), the clipped
    global norm (one norm over parameters on two meshes) and the parameters as unsharded
    data-parallel training's (module doc)."""
    own = ctx.mesh((2, ctx.world_size // 2), ("ep", "dp_shard_mod_ep"))
    spec = ShardSpec(strategy="FULL_SHARD", mesh=ctx.mesh(), unit_meshes={experts.EXPERT_UNIT: own})
    train_in_parity(ctx, impl, experts.RoutedNet, spec, MESH_RECIPES[clip], experts.batches(ctx, "every_expert", STEPS))
