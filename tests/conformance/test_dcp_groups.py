"""`adapters.dcp.group_of`: DCP saves and loads over the group that spans the model's ranks, with one
coordinator for them all. HYBRID_SHARD's replicas were once two saves into one folder (FSDP1's
`process_group` is one replica's shard group): two coordinators renamed the same `.metadata.tmp`,
and torch 2.9.1 failed the race ("No such file or directory: .../.metadata.tmp")."""

from __future__ import annotations

import torch.nn as nn

from shardcheck.conformance.adapters import dcp, load
from shardcheck.conformance.protocol import ShardSpec
from shardcheck.harness import distributed


@distributed(world_size=4, backend="gloo")
def test_a_hybrid_shard_model_is_saved_over_every_rank(ctx):
    mesh = ctx.mesh((2, 2), ("replicate", "shard"))
    for name in ("torch-fsdp1", "torch-fsdp2"):
        with ctx.seeded(0):
            model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        sharded = load(name).shard(model, ShardSpec(strategy="HYBRID_SHARD", units=("0", "1"), mesh=mesh))
        assert dcp.group_of(sharded) is None, f"{name}: saves over {dcp.group_of(sharded)}, not every rank"
