"""`adapters.dtensors.full_tensors`: the whole values of many DTensors in one all-gather per shard
group and dtype, equal to `full_tensor()` for every layout (FSDP's row sharding, uneven and empty
shards, 2-D meshes, other placements through `full_tensor()` itself)."""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

from shardcheck.conformance.adapters.dtensors import full_tensors
from shardcheck.harness import distributed


@distributed(world_size=[2, 3, 4])
def test_full_tensors_equal_full_tensor(ctx):
    with ctx.seeded(0):
        values = {
            "even": torch.randn(8, 3), "uneven": torch.randn(5, 2, 2), "one_row": torch.randn(1, 4),
            "vector": torch.randn(7), "ints": torch.arange(10), "bools": torch.arange(6) % 2 == 0,
            "bf16": torch.randn(3, 3).bfloat16(), "cols": torch.randn(2, 6), "scalar": torch.tensor(3.0),
            "empty": torch.empty(0, 3),
        }
    mesh = ctx.mesh()
    dt = {n: distribute_tensor(v, mesh, [Shard(1) if n == "cols" else Replicate() if n == "scalar" else Shard(0)])
          for n, v in values.items()}
    dt["plain"], values["plain"] = values["even"], values["even"]
    dt["none"], values["none"] = None, None
    if ctx.world_size == 4:  # HSDP's layout: (replicate, shard)
        mesh2 = ctx.mesh((2, 2), ("replicate", "shard"))
        dt["hsdp"], values["hsdp"] = distribute_tensor(values["uneven"], mesh2, [Replicate(), Shard(0)]), values["uneven"]
    with CommDebugMode() as comms:
        got = full_tensors(dt)
    # float32, int64, bool, bfloat16 of the 1-D mesh, float32 of the 2-D mesh's shard group; and
    # the column-sharded and the empty one through full_tensor() (CommDebugMode does not see the
    # threaded backend's collectives)
    assert ctx.is_threaded or sum(comms.get_comm_counts().values()) == 6 + (ctx.world_size == 4), comms.get_comm_counts()
    assert list(got) == list(dt)
    for name, want in values.items():
        if want is None:
            assert got[name] is None
            continue
        assert got[name].dtype == want.dtype and torch.equal(got[name], want), name
        if hasattr(dt[name], "full_tensor"):
            assert torch.equal(got[name], dt[name].full_tensor()), name
    got["even"].add_(1)  # a copy, never a view of the DTensor's local data
    assert torch.equal(dt["even"].full_tensor(), values["even"])


@distributed(world_size=[2, 3])
def test_a_wrapper_subclass_is_read_through_its_inner_tensors(ctx):
    """A TwoTensor DTensor comes back a TwoTensor of plain, finished tensors, gathered with the plain
    ones (one all-gather): `full_tensor()` would return its components still in flight (F67)."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor

    from shardcheck.conformance.checks.support.subclasses import TwoTensor

    with ctx.seeded(0):
        a, b, plain = torch.randn(5, 3), torch.randn(5, 3), torch.randn(4, 2)
    mesh = ctx.mesh()
    rows = [r.clone() for r in a.chunk(ctx.world_size)], [r.clone() for r in b.chunk(ctx.world_size)]
    local = TwoTensor(*(r[ctx.rank] if ctx.rank < len(r) else r[0].new_empty(0, 3) for r in rows))
    two = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=a.shape, stride=a.stride())
    dt = {"two": two, "plain": distribute_tensor(plain, mesh, [Shard(0)])}
    with CommDebugMode() as comms:
        got = full_tensors(dt)
    assert ctx.is_threaded or sum(comms.get_comm_counts().values()) == 1, comms.get_comm_counts()
    assert type(got["two"]) is TwoTensor and got["two"].shape == a.shape
    for part, want in (("a", a), ("b", b)):
        value = getattr(got["two"], part)
        assert type(value) is torch.Tensor and not isinstance(value, AsyncCollectiveTensor), type(value)
        assert torch.equal(value, want), part
    assert torch.equal(got["plain"], plain)
