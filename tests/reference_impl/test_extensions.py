"""All-gather extensions (seed 002): TwoTensor subclass parity, monkey patching, bad input sizes."""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.testing._internal.two_tensor import TwoTensor

import shardcheck.reference_impl as R
from shardcheck.harness import distributed
from ri_models import WS


def two_tensor_pre(self, mesh):
    return (self.a, self.b), None


def two_tensor_post(self, outputs, metadata, param_dtype, *, out=None):
    assert metadata is None
    a, b = outputs
    if out is not None:
        if a.dtype == param_dtype:  # out= must alias the fresh all-gather outputs
            assert a.untyped_storage().data_ptr() == out.a.untyped_storage().data_ptr()
        else:
            out.a.copy_(a)
            out.b.copy_(b)
        return
    return TwoTensor(a, b).to(param_dtype), (a, b)


class MLP(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.in_proj = nn.Linear(d, 2 * d + 1, bias=False)  # 17 rows: uneven at 2, 3, 4
        self.out_proj = nn.Linear(2 * d + 1, d, bias=False)

    def forward(self, x):
        return self.out_proj(torch.relu(self.in_proj(x)))


def two_tensor_mlp():
    model = nn.Sequential(*[MLP() for _ in range(3)])
    for mlp in model:
        for lin in (mlp.in_proj, mlp.out_proj):
            lin.weight = nn.Parameter(TwoTensor(lin.weight, lin.weight.clone()))
    return model


def _patch_two_tensor(ctx):
    if not hasattr(TwoTensor, "fsdp_pre_all_gather"):  # once per process (threads share the class)
        TwoTensor.fsdp_pre_all_gather = two_tensor_pre
        TwoTensor.fsdp_post_all_gather = two_tensor_post


@distributed(world_size=WS)
@pytest.mark.parametrize("strategy", [R.ShardingStrategy.FULL_SHARD, R.ShardingStrategy.SHARD_GRAD_OP])
def test_two_tensor_train_parity(ctx, strategy):
    _patch_two_tensor(ctx)
    with ctx.seeded(42):
        ref = two_tensor_mlp()
    model = copy.deepcopy(ref)
    for mlp in model:
        R.shard(mlp, process_group=ctx.group, strategy=strategy)
    R.shard(model, process_group=ctx.group, strategy=strategy)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2, foreach=True)
    with ctx.seeded(ctx.rank + 1):
        x = torch.randn(2, 8)
    for step in range(3):
        losses = [m(x).sum() for m in (ref, model)]
        for loss in losses:
            loss.backward()
        for p in ref.parameters():
            for t in (p.grad.a, p.grad.b):
                dist.all_reduce(t, group=ctx.group)
                t /= ctx.world_size
        torch.testing.assert_close(losses[0].a if isinstance(losses[0], TwoTensor) else losses[0],
                                   losses[1].a if isinstance(losses[1], TwoTensor) else losses[1])
        got = R.full_grads(model)
        for n, p in ref.named_parameters():
            assert isinstance(got[n], TwoTensor), n
            torch.testing.assert_close(got[n].a, p.grad.a, msg=n)
            torch.testing.assert_close(got[n].b, p.grad.b, msg=n)
        opt.step(), ref_opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0), ref_opt.zero_grad(set_to_none=step % 2 == 0)
    state = R.full_state(model)
    for n, p in ref.named_parameters():
        torch.testing.assert_close(state[n].a, p.a, msg=n)


@distributed(world_size=WS)
def test_monkey_patch_after_meta_init(ctx):
    """Seed 002: meta init, shard, to_empty, init, then patch plain tensors with (self)-only hooks."""
    calls = []

    def pre(self):
        calls.append("pre")
        return (self.to(torch.bfloat16),), None

    def post(self, outputs, metadata, param_dtype, *, out=None):
        (t,) = outputs
        assert metadata is None and t.dtype == torch.bfloat16
        if out is not None:
            out.copy_(t)
            return
        return t.to(param_dtype), (t,)

    with torch.device("meta"):
        model = nn.Sequential(*[MLP() for _ in range(3)])
    for mlp in model:
        R.shard(mlp, process_group=ctx.group, mixed_precision=R.MixedPrecision(param_dtype=torch.bfloat16))
    R.shard(model, process_group=ctx.group, mixed_precision=R.MixedPrecision(param_dtype=torch.bfloat16))
    model.to_empty(device=ctx.device)
    with ctx.seeded(0):
        for p in model.parameters():
            nn.init.trunc_normal_(p)
    for name, p in model.named_parameters():
        if "weight" in name:
            shard = R.local_shard(p)
            shard.fsdp_pre_all_gather = pre
            shard.fsdp_post_all_gather = post
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
    with ctx.seeded(ctx.rank + 1):
        x = torch.randn(2, 8)
    for _ in range(3):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
    assert len(calls) >= 3 * 6
    assert all(p.grad is None and p.dtype == torch.float32 for p in model.parameters())


@distributed(world_size=WS)
def test_wrong_sized_inputs_raise_on_every_rank(ctx):
    """A pre hook returning a wrong dim-0 size on one rank only must fail on every rank, not hang."""
    last = ctx.world_size - 1

    def pre(self):
        return ((torch.cat([self, self]) if ctx.rank == last else self),), None

    def post(self, outputs, metadata, param_dtype, *, out=None):
        return outputs[0], ()

    model = R.shard(nn.Linear(8, 8, bias=False), process_group=ctx.group)
    shard = R.local_shard(model.weight)
    shard.fsdp_pre_all_gather, shard.fsdp_post_all_gather = pre, post
    with pytest.raises(ValueError, match="wrong size"):
        model(torch.ones(1, 8))
