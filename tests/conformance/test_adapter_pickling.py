"""An adapter travels to the rank processes by pickle (pool and spawn modes): what it made for the
ranks of one process stays behind. torch-fsdp2's NO_SHARD meshes did not: a mesh made by a threaded
cell in the pytest process holds a tensor, which pickling sent to the next gloo cell's ranks through
shared memory, and the harness failed that cell for the file descriptors it was left holding. They
are now kept by the module (torch_fsdp2.strategy_mesh), not the adapter."""

from __future__ import annotations

import pickle

import torch.nn as nn

from shardcheck.conformance.adapters import load
from shardcheck.conformance.protocol import ShardSpec
from shardcheck.harness import distributed


@distributed(world_size=2)
def test_fsdp2_adapter_leaves_its_meshes_behind(ctx):
    impl = load("torch-fsdp2")
    impl.shard(nn.Linear(4, 2), ShardSpec(strategy="NO_SHARD", mesh=ctx.mesh()))
    data = pickle.dumps(impl)
    assert b"DeviceMesh" not in data and b"Storage" not in data, "the adapter pickles the meshes it made"
    assert pickle.loads(data).name == impl.name
