"""Resharding checkpoints (family checkpoint): saved at one world size, loaded at another.

After torch's DCP resharding tests (`test_fsdp_dsd.py`, `test_dtensor_resharding.py`): 2 steps on
`save_world_size` ranks, save, a fresh trainer on `load_world_size` ranks loads and trains 2 more
steps. Uneven rows (UnevenMLP: 5, 3 and 1 rows) make the layouts of 2 and 4 ranks differ in every
parameter, padding included. The comparison is the unsharded run whose data-parallel world changes
with the phase (support/checkpoint.py): parameters, gradients, losses and Adam's state continue.
The test runs at the larger world size; the smaller phase runs on the first ranks' sub-group.
"""

from __future__ import annotations

import pytest

from shardcheck.conformance.checks.support.checkpoint import train_across_checkpoint
from shardcheck.conformance.checks.support.workloads import WORKLOADS
from shardcheck.conformance.protocol import Clip, Optimizer, Recipe, ShardSpec
from shardcheck.conformance.protocol.capabilities import of_strategy
from shardcheck.harness import distributed

W = WORKLOADS["uneven_mlp"]


@distributed(world_size=4)
@pytest.mark.requires.with_args(lambda params: {of_strategy(params["strategy"]), "clip_norm_2", "checkpoint", "checkpoint_reshard"})
@pytest.mark.parametrize("save_world_size,load_world_size", [(4, 2), (2, 4)], ids=["4to2", "2to4"])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "SHARD_OPTIMIZER"])
def test_reshard(ctx, impl, strategy, save_world_size, load_world_size, tmp_path):
    recipe = Recipe(loss_fn=W.loss_fn, optimizer=Optimizer("adam", lr=1e-2), clip=Clip(1.0, 2.0))
    spec_of = lambda mesh: ShardSpec(strategy=strategy, units=W.units, mesh=mesh)  # noqa: E731
    train_across_checkpoint(ctx, impl, W, recipe, tmp_path / "ckpt", save_size=save_world_size,
                            load_size=load_world_size, spec_of=spec_of)
