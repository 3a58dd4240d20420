"""Mixed precision, clip_grad_norm_, the sharded grad scaler and communication hooks."""
import contextlib
import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor.debug import CommDebugMode

import shardcheck.reference_impl as R
from shardcheck.harness import distributed
from ri_models import S, apply_sharding, build, make_input, sharded_copy, average_grads, WS


# ------------------------------------------------------------------------------ mixed precision
@distributed(world_size=WS)
@pytest.mark.parametrize("cfg", ["bf16_param_fp32_reduce", "fp16_all_keep_low"])
def test_mixed_precision(ctx, cfg):
    if cfg == "bf16_param_fp32_reduce":
        mp = R.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        mp = R.MixedPrecision(torch.float16, torch.float16, torch.float16, keep_low_precision_grads=True)
    ref = build("nested", ctx)
    model = sharded_copy(ref, ctx, S.FULL_SHARD, mixed_precision=mp)
    low = copy.deepcopy(ref).to(mp.param_dtype)  # the unsharded computation in param_dtype
    x = make_input("nested", ctx, 0)
    out = model(x)
    assert out.dtype == mp.param_dtype
    out.float().sum().backward()
    low(x.to(mp.param_dtype)).float().sum().backward()
    for p in low.parameters():
        if p.grad is not None:
            g = p.grad.to(mp.reduce_dtype) / ctx.world_size
            dist.all_reduce(g, group=ctx.group)
            p.grad = g.to(p.dtype)
    got = R.full_grads(model)
    for (n, p), (_, lp) in zip(model.named_parameters(), low.named_parameters()):
        if p.grad is None:
            assert lp.grad is None, n
            continue
        assert p.grad.dtype == (mp.reduce_dtype if mp.keep_low_precision_grads else torch.float32), n
        torch.testing.assert_close(got[n].float(), lp.grad.float(), atol=2e-2, rtol=2e-2, msg=n)
    for p in model.parameters():
        assert p.dtype == torch.float32
    if cfg == "fp16_all_keep_low":
        shared = apply_sharding(build("shared", ctx), ctx, S.FULL_SHARD, mixed_precision=mp)
        assert shared.shift.dtype == torch.float16


# ------------------------------------------------------------------------------ clip_grad_norm_
@distributed(world_size=WS)
@pytest.mark.parametrize("strategy", [S.FULL_SHARD, S.NO_SHARD, "mixed", S.HYBRID_SHARD])
def test_clip_grad_norm_parity(ctx, strategy):
    ref = build("shared", ctx)
    mesh = ctx.mesh((1, ctx.world_size) if ctx.world_size != 4 else (2, 2), ("replicate", "shard")) if strategy is S.HYBRID_SHARD else None
    model = sharded_copy(ref, ctx, strategy, mesh=mesh)
    for step, (max_norm, norm_type) in enumerate([(1, 2), (2.5, 1), (0.5, 3), (1, math.inf), (0.1, 2.0)]):
        x = make_input("shared", ctx, step)
        for m in (ref, model):
            m.zero_grad()
            m(x).sum().backward()
            for p in m.parameters():
                if p.grad is not None:
                    p.grad *= 100  # so that clipping really happens
        average_grads(ref, ctx)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type)
        # CommDebugMode's state is process-global: it only works with one rank per process
        with contextlib.nullcontext() if ctx.is_threaded else CommDebugMode() as comm:
            norm = R.clip_grad_norm_(model, max_norm, norm_type)
        if ctx.world_size > 1 and not ctx.is_threaded:
            assert sum(comm.get_comm_counts().values()) == 1, comm.get_comm_counts()
        torch.testing.assert_close(norm, ref_norm, rtol=1e-4, atol=1e-4)
        got = R.full_grads(model)
        for n, p in ref.named_parameters():
            torch.testing.assert_close(got[n], p.grad, rtol=1e-4, atol=1e-5, msg=n)


@distributed(world_size=WS)
def test_clip_grad_norm_edge_cases(ctx):
    # non-root
    model = nn.Sequential(nn.Linear(5, 5), nn.Linear(5, 5))
    R.shard(model[1], process_group=ctx.group)
    R.shard(model, process_group=ctx.group)
    model(torch.ones(2, 5)).sum().backward()
    with pytest.raises(RuntimeError, match="should only be called on the root"):
        R.clip_grad_norm_(model[1], 2)
    # low-precision gradients: the norm has their dtype
    mp = R.MixedPrecision(torch.float16, torch.float16, keep_low_precision_grads=True)
    for strategy in (S.FULL_SHARD, S.NO_SHARD):
        m = sharded_copy(build("nested", ctx), ctx, strategy, mixed_precision=mp)
        m(make_input("nested", ctx, 0)).sum().backward()
        assert all(p.grad.dtype == torch.float16 for p in m.parameters() if p.grad is not None)
        for norm_type in (1, 2, math.inf):
            total = R.clip_grad_norm_(m, 1.0, norm_type)
            assert total.dtype == torch.float16
            for p in m.parameters():
                if p.grad is not None and p.grad.numel():
                    assert torch.linalg.vector_norm(p.grad.float(), norm_type) <= 1.0 + 1e-3
    # no gradients: warn, fp32 zero
    lin = R.shard(nn.Linear(24, 24), process_group=ctx.group, strategy=S.SHARD_GRAD_OP,
                  mixed_precision=R.MixedPrecision(torch.float16, torch.float32, torch.float32))
    lin(torch.randn(3, 24))
    # warning capture is process-wide, so under threads ranks would see each other's warnings
    with contextlib.nullcontext() if ctx.is_threaded else pytest.warns(
            UserWarning, match=f"on rank {ctx.rank} with no gradients -- returning the total "
                               "norm in the default dtype torch.float32"):
        total = R.clip_grad_norm_(lin, 1)
    assert total.dtype == torch.float32 and total.item() == 0.0


# ------------------------------------------------------------------------------ grad scaler
@distributed(world_size=WS)
def test_grad_scaler_unit(ctx):
    """Seed 001's single-scaler checks (scale nested outputs, sparse unscale, inf skips step)."""
    scaler = R.ShardedGradScaler(init_scale=2.0, process_group=ctx.group)
    t0, t1 = torch.full((1,), 4.0), torch.full((1,), 8.0)
    outputs = scaler.scale([t1.clone(), (t0.clone(), t1.clone()), [t0.clone(), t1.clone()]])
    assert outputs[0] == 16.0 and outputs[1][0] == 8.0 and outputs[1][1] == 16.0
    assert isinstance(outputs[1], tuple) and outputs[2][0] == 8.0 and outputs[2][1] == 16.0
    assert scaler._scale.device == t1.device

    inv_scale, found_inf = torch.full((1,), 0.5), torch.zeros(1)
    i = torch.tensor([[0, 1, 1], [2, 0, 2]])
    s = torch.sparse_coo_tensor(i, torch.tensor([16.0, 32.0, 64.0]), (2, 3))
    s1 = s.clone()
    s1.grad = s.clone()
    opt = torch.optim.SGD([s1], lr=1.0)
    assert scaler._unscale_grads_(opt, inv_scale, found_inf)[s1.device] == 0.0
    torch.testing.assert_close(s1.grad.to_dense(), (s / 2).to_dense())
    s1.grad = torch.sparse_coo_tensor(i, torch.tensor([16.0, 32.0, float("inf")]), (2, 3))
    found_inf.zero_()
    assert scaler._unscale_grads_(opt, inv_scale, found_inf)[s1.device] == 1.0
    i = torch.tensor([[1, 1, 1], [0, 0, 2]])
    s1 = torch.sparse_coo_tensor(i, torch.tensor([2**15, 2**15, 1.0], dtype=torch.float16), (2, 3))
    s1.grad = s1.clone()
    found_inf.zero_()
    assert scaler._unscale_grads_(opt, inv_scale, found_inf)[s1.device] == 1.0

    scaler = R.ShardedGradScaler(init_scale=2.0, process_group=ctx.group)
    t = torch.tensor([float("inf")])
    t.grad = t.clone()
    scaler.scale(torch.full((1,), 4.0))
    assert scaler.step(torch.optim.SGD([t], lr=1.0)) is None


@distributed(world_size=WS)
@pytest.mark.parametrize("strategy", [S.FULL_SHARD, S.SHARD_GRAD_OP, S.NO_SHARD])
def test_grad_scaler_parity_and_found_inf(ctx, strategy):
    ref = build("nested", ctx)
    model = sharded_copy(ref, ctx, strategy)
    opt, ref_opt = torch.optim.Adam(model.parameters(), lr=1e-2), torch.optim.Adam(ref.parameters(), lr=1e-2)
    scaler = R.ShardedGradScaler(init_scale=2.0**4, process_group=ctx.group)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    for step in range(3):
        x = make_input("nested", ctx, step)
        scaler.scale(model(x).sum()).backward()
        ref_scaler.scale(ref(x).sum()).backward()
        average_grads(ref, ctx)
        if step == 1 and ctx.rank == ctx.world_size - 1:  # overflow seen by one rank only
            next(p for p in model.parameters() if p.grad is not None and p.grad.numel()).grad[0] = float("inf")
        before = {n: t.clone() for n, t in R.full_state(model).items()}
        scaler.step(opt)
        scaler.update()
        if step == 1:  # every rank skipped the step and backed off
            assert scaler.get_scale() == 2.0**3
            for n, t in R.full_state(model).items():
                assert torch.equal(t, before[n]), n
        else:
            ref_scaler.step(ref_opt)
            ref_scaler.update()
            for n, t in R.full_state(model).items():
                torch.testing.assert_close(t, dict(ref.named_parameters())[n].detach(), atol=1e-5, rtol=1e-4, msg=n)
        ctx.assert_equal_across_ranks(scaler.get_scale(), "scale")
        opt.zero_grad()
        ref_opt.zero_grad()


# ------------------------------------------------------------------------------ comm hooks
class Net(nn.Module):
    def __init__(self, ctx, strategy, wrap, mp=None):
        super().__init__()
        with ctx.seeded(0):
            self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
            self.out = nn.Linear(8, 4)
        if wrap:
            R.shard(self.net[2], process_group=ctx.group, strategy=strategy, mixed_precision=mp)
            R.shard(self.net, process_group=ctx.group, strategy=strategy, mixed_precision=mp)
        R.shard(self, process_group=ctx.group, strategy=strategy, mixed_precision=mp)

    def forward(self, x):
        return self.out(F.relu(self.net(x)))


class DummyState:
    __slots__ = ["process_group", "noise"]

    def __init__(self, process_group, noise):
        self.process_group, self.noise = process_group, noise


def dummy_hook(state, grad, output=None):
    grad.add_(state.noise)


STRATS = [S.NO_SHARD, S.FULL_SHARD, S.SHARD_GRAD_OP]


@distributed(world_size=WS)
@pytest.mark.parametrize("strategy", STRATS)
def test_default_hook_behavior(ctx, strategy):
    """Seed 004: weight 1 x N, input = rank; every rank's grad is the mean of the ranks."""
    with ctx.seeded(0):
        net = R.shard(nn.Linear(1, ctx.world_size, bias=False), process_group=ctx.group, strategy=strategy)
    assert all(u.comm_hook is None for u in R.units(net))
    for _ in range(2):
        net.zero_grad()
        net(torch.tensor([float(ctx.rank)])).sum().backward()
        assert net.weight.grad[0].item() == sum(range(ctx.world_size)) / ctx.world_size


@distributed(world_size=WS)
@pytest.mark.parametrize("strategy", STRATS)
def test_hook_registration(ctx, strategy):
    for wrap in (True, False):
        model = Net(ctx, strategy, wrap)
        assert all(u.comm_hook is None for u in R.units(model))
        state = DummyState(ctx.group, 1234)
        R.register_comm_hook(model, state, dummy_hook)
        with pytest.raises(AssertionError, match="^A communication hook is already registered$"):
            R.register_comm_hook(model, state, dummy_hook)
        assert len(R.units(model)) == (3 if wrap else 1)
        for u in R.units(model):
            assert u.comm_hook is dummy_hook and u.comm_hook_state is state
    model = Net(ctx, strategy, True)
    with pytest.raises(AssertionError, match="^register_comm_hook can only be called on a root instance.$"):
        R.register_comm_hook(model.net, DummyState(ctx.group, 1), dummy_hook)
    R.units(model)[2].comm_hook = dummy_hook
    with pytest.raises(AssertionError, match="^A communication hook is already registered$"):
        R.register_comm_hook(model, DummyState(ctx.group, 1), dummy_hook)


@distributed(world_size=WS)
@pytest.mark.parametrize("strategy", STRATS)
def test_builtin_hooks(ctx, strategy):
    group = ctx.group or dist.group.WORLD
    x = make_input("nested", ctx, 0).repeat(1, 2)[:, :8]
    cases = [
        (R.DefaultState(group), R.allreduce_hook if strategy is S.NO_SHARD else R.reduce_scatter_hook, None),
        (R.LowPrecisionState(group), R.fp16_compress_hook, torch.float16),
        (R.LowPrecisionState(group), R.bf16_compress_hook, torch.bfloat16),
    ]
    for state, hook, dtype in cases:
        for wrap in (True, False):
            with_hook = Net(ctx, strategy, wrap)
            R.register_comm_hook(with_hook, state, hook)
            mp = R.MixedPrecision(reduce_dtype=dtype) if dtype else None
            with_mp = Net(ctx, strategy, wrap, mp)
            with_hook(x).sum().backward()
            with_mp(x).sum().backward()
            for p, q in zip(with_hook.parameters(), with_mp.parameters()):
                assert p.grad.dtype == torch.float32
                torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
