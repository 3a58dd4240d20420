"""Training parity of reference_impl with an unsharded model whose gradients are averaged."""
import copy

import pytest
import torch
import torch.nn as nn

import shardcheck.reference_impl as R
from shardcheck.harness import distributed
from ri_models import S, SharedTransformer, apply_sharding, build, sharded_copy, train_parity, WS


@distributed(world_size=WS)
@pytest.mark.parametrize("kind,strategy", [
    *[("shared", s) for s in (S.FULL_SHARD, S.SHARD_GRAD_OP, S.NO_SHARD, "mixed")],
    *[("nested", s) for s in (S.FULL_SHARD, S.SHARD_GRAD_OP, S.NO_SHARD)],
])
def test_train_parity(ctx, kind, strategy):
    ref = build(kind, ctx)
    model = sharded_copy(ref, ctx, strategy)
    # the shards really are torch.chunk rows, and the optimizer sees only shards
    for u in R.units(model):
        for sp in u.params:
            rows = sp.slot.shape[0] if sp.slot.shape else 1
            expected = torch.chunk(torch.empty(rows), u.shard_size)
            n = expected[u.shard_rank].numel() if u.shard_rank < len(expected) else 0
            assert sp.shard.shape[0] == n
    train_parity(ctx, kind, model, ref)


@distributed(world_size=[*WS, 4])  # 4: the (2, 2) mesh
def test_hybrid_shard(ctx):
    ws = ctx.world_size
    shapes = {(1, ws), (ws, 1)} | ({(2, 2)} if ws == 4 else set())
    for shape in sorted(shapes):
        mesh = ctx.mesh(shape, ("replicate", "shard"))
        ref = build("shared", ctx)
        model = apply_sharding(copy.deepcopy(ref), ctx, S.HYBRID_SHARD, mesh=mesh)
        train_parity(ctx, "shared", model, ref, steps=2)


@distributed(world_size=WS)
def test_offload_and_eval(ctx):
    ref = build("nested", ctx)
    model = sharded_copy(ref, ctx, S.FULL_SHARD, offload=True)
    for p in model.parameters():
        assert p.device.type == "cpu"
    train_parity(ctx, "nested", model, ref, steps=2)
    with torch.no_grad():
        x = torch.full((2, 5), 0.3)
        torch.testing.assert_close(model(x), ref(x))
    assert all(u.full is None for u in R.units(model))


@distributed(world_size=WS)
def test_meta_init(ctx):
    """Seed 002's flow: build on meta, shard, ``to_empty``, initialise, train."""
    ref = build("shared", ctx)
    with torch.device("meta"):
        model = SharedTransformer()
    apply_sharding(model, ctx, S.FULL_SHARD)
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device=ctx.device)
    model.shift = ref.shift.clone()  # buffers are not sharded: initialise them like the reference
    with R.full_params(model):  # write the reference values into the shards
        for (n, p), (_, rp) in zip(model.named_parameters(), ref.named_parameters()):
            p.data.copy_(rp)
    train_parity(ctx, "shared", model, ref, steps=2)


@distributed(world_size=WS)
def test_gradient_accumulation_and_reuse(ctx):
    """Two forwards before one backward, and a module used twice in one forward."""
    with ctx.seeded(0):
        ref = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3))
    model = copy.deepcopy(ref)
    R.shard(model[0], process_group=ctx.group)
    R.shard(model, process_group=ctx.group)
    for m in (ref, model):
        x = torch.full((2, 4), 0.5 + ctx.rank)
        (m(x).sum() + m[0](m[0](x)).sum()).backward()
        m(x * 2).sum().backward()
    for p in ref.parameters():
        torch.distributed.all_reduce(p.grad, group=ctx.group)
        p.grad /= ctx.world_size
    got = R.full_grads(model)
    for n, p in ref.named_parameters():
        torch.testing.assert_close(got[n], p.grad, msg=n)


@distributed(world_size=WS)
def test_tied_across_units_is_rejected(ctx):
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    model[1].weight = model[0].weight
    R.shard(model[0], process_group=ctx.group)
    with pytest.raises(ValueError, match="tied"):
        R.shard(model, process_group=ctx.group)


@distributed(world_size=[1, 2, 3])
def test_all_gather_flat_many_is_one_all_gather_flat_per_buffer(ctx):
    """What full_params and full_grads rely on to read every unit in one collective."""
    from shardcheck.reference_impl import collectives as C

    group = ctx.group or torch.distributed.group.WORLD
    locals_ = [torch.arange(n, dtype=torch.float32) + 100 * ctx.rank + 10 * i for i, n in enumerate((3, 1, 0, 5))]
    many = C.all_gather_flat_many(locals_, group)
    one_by_one = [C.all_gather_flat(x, group) for x in locals_]
    assert [m.shape for m in many] == [o.shape for o in one_by_one]
    assert all(torch.equal(m, o) for m, o in zip(many, one_by_one))
