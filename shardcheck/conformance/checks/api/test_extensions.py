"""All-gather extensions (seed 002, torch's test_fully_shard_extensions.py).

A local shard may define ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` to choose what is
all-gathered. Seed cases: TwoTensor train parity (reshard_after_forward True/False), meta-device
init + bf16 param_dtype end to end, and monkey-patched hooks on plain tensors. Added: both pre-hook
signatures, uneven shards (padding), and a pre hook returning wrongly sized inputs, which must
raise on every rank rather than leave some ranks blocked in the all-gather.

The hooks live on a TwoTensor subclass built per rank (`_two_tensor_cls`), so nothing global is
patched (thread mode shares classes) and every rank counts its own hook calls.
"""

from __future__ import annotations

import copy
import math
import re
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from shardcheck.conformance.protocol import MixedPrecision, ShardSpec
from shardcheck.conformance.checks.support.compare import assert_close
from shardcheck.conformance.checks.support.dp_reference import average_gradients_
from shardcheck.conformance.checks.support.models import MLP
from shardcheck.conformance.checks.support.subclasses import TwoTensor
from shardcheck.conformance.checks.support.tensors import full_value, local_part
from shardcheck.harness import distributed

pytestmark = pytest.mark.requires("all_gather_extensions")


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    return x if x.shape[0] == rows else torch.cat([x, x.new_zeros(rows - x.shape[0], *x.shape[1:])])


def _two_tensor_cls(signature: str, calls: dict, wrong_size_on: int | None = None, pad: bool = True):
    """A TwoTensor subclass with the seed's hooks; `signature` "5" (mesh, outer_size, outer_stride,
    module, mp_policy; pads to ceil(rows / shards) as FSDP2 requires) or "legacy" (mesh).
    `wrong_size_on`: a rank whose pre hook returns one row too many. `pad=False`: the rank's own
    rows as they are, fewer on the last ranks of an uneven shard (torchao's float8 did: ao#3982)."""

    def _inputs(self, mesh, rows):
        chunk = math.ceil(rows / mesh.size()) if rows is not None and pad else self.a.shape[0]
        if wrong_size_on is not None and dist.get_rank() == wrong_size_on:
            chunk += 1
        return (_pad_rows(self.a, chunk), _pad_rows(self.b, chunk)), None

    class HookedTwoTensor(TwoTensor):
        @staticmethod
        def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
            return HookedTwoTensor(inner["a"], inner["b"], outer_size, outer_stride)

        if signature == "5":
            def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
                calls["pre"] += 1
                return _inputs(self, mesh, outer_size[0])
        else:
            def fsdp_pre_all_gather(self, mesh):
                calls["pre"] += 1
                return _inputs(self, mesh, None)

        def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
            calls["post"] += 1
            calls.setdefault("param_dtypes", set()).add(str(param_dtype))
            assert metadata is None, f"{metadata}"
            a, b = outputs
            if out is not None:
                assert isinstance(out, TwoTensor), f"{type(out)}"
                if a.dtype == param_dtype:
                    assert a.untyped_storage().data_ptr() == out.a.untyped_storage().data_ptr()
                    assert b.untyped_storage().data_ptr() == out.b.untyped_storage().data_ptr()
                else:
                    assert out.a.dtype == param_dtype, f"{out.a.dtype} {param_dtype}"
                    assert out.b.dtype == param_dtype, f"{out.b.dtype} {param_dtype}"
                    out.a.copy_(a)
                    out.b.copy_(b)
                return None
            return HookedTwoTensor(a, b).to(param_dtype), (a, b)

    return HookedTwoTensor


def _to_two_tensor(model: nn.Module, cls) -> nn.Module:
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.weight = nn.Parameter(cls(module.weight.detach(), module.weight.detach().clone()))
    return model


def _mlp_stack(meta: bool = False) -> nn.Module:
    with torch.device("meta" if meta else "cpu"):
        return nn.Sequential(*[MLP(8, bias=False) for _ in range(3)])


def _split(actual: dict, expected: dict) -> tuple[dict, dict]:
    """TwoTensor values compared as their two components. A plain tensor where the other side has a
    TwoTensor (FSDP2 reduces a TwoTensor parameter's gradient into a plain tensor; the seed's
    assertEqual accepts that) must equal both components."""
    act, exp = {}, {}
    for name in expected.keys() | actual.keys():
        a, e = (d.get(name) for d in (actual, expected))
        a, e = full_value(a), full_value(e)
        if isinstance(e, TwoTensor) or isinstance(a, TwoTensor):
            for part in "ab":
                act[f"{name}.{part}"] = getattr(a, part) if isinstance(a, TwoTensor) else a
                exp[f"{name}.{part}"] = getattr(e, part) if isinstance(e, TwoTensor) else e
        else:
            act[name], exp[name] = a, e
    return act, exp


def _average_grads(ctx, model: nn.Module) -> None:
    grads = [p.grad for p in model.parameters()]
    average_gradients_([t for g in grads if g is not None
                        for t in ((g.a, g.b) if isinstance(g, TwoTensor) else (g,))], ctx.group)


def _check_parity(ctx, impl, ref, model, what, grads=True):
    assert_close(ctx, *_split(impl.full_params(model), dict(ref.named_parameters())), f"params {what}")
    if grads:
        ref_grads = {n: p.grad for n, p in ref.named_parameters()}
        assert_close(ctx, *_split(impl.full_grads(model), ref_grads), f"grads {what}")


def _train_parity(ctx, impl, ref, model, spec, iters, calls):
    model = impl.shard(model, spec)
    ref_optim = torch.optim.Adam(ref.parameters(), lr=1e-2, foreach=True)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
    _check_parity(ctx, impl, ref, model, "init", grads=False)
    with ctx.seeded(42 + ctx.rank + 1):
        inp = torch.randn((2, 8), device=ctx.device)
    for it in range(iters):
        losses = []
        for m in (ref, model):
            losses.append(m(inp).sum())
            losses[-1].backward()
        _average_grads(ctx, ref)
        assert_close(ctx, losses[1], losses[0], f"loss it{it}")
        _check_parity(ctx, impl, ref, model, f"after backward it{it}")
        for o in (ref_optim, optim):
            o.step()
            o.zero_grad(set_to_none=(it % 2 == 0))
        # the seed's check_sharded_parity after step + zero_grad: parameters, and gradients None on
        # both sides (set_to_none=True) or zeros on both sides (set_to_none=False)
        _check_parity(ctx, impl, ref, model, f"after step + zero_grad(set_to_none={it % 2 == 0}) it{it}")
        got = impl.full_grads(model)
        for n, p in ref.named_parameters():
            assert (got.get(n) is None) == (p.grad is None), \
                f"it{it}: {n}: grad {'None' if got.get(n) is None else 'kept'} after zero_grad(set_to_none={it % 2 == 0})"
    assert calls["pre"] > 0 and calls["post"] > 0, f"all-gather hooks never ran: {calls}"
    ctx.record("hook_calls", {k: v for k, v in calls.items() if k != "param_dtypes"})


@distributed(world_size=[2, 4])
@pytest.mark.parametrize("signature", ["5", "legacy"])
@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_train_parity(ctx, impl, reshard_after_forward, signature):
    """Seed: TwoTensor MLP stack trains like the unsharded model; the hooks must actually run."""
    calls = {"pre": 0, "post": 0}
    cls = _two_tensor_cls(signature, calls)
    with ctx.seeded(42):
        plain = _mlp_stack()
    ref = _to_two_tensor(copy.deepcopy(plain), TwoTensor).to(ctx.device)
    model = _to_two_tensor(plain, cls).to(ctx.device)
    spec = ShardSpec(strategy="FULL_SHARD" if reshard_after_forward else "SHARD_GRAD_OP", units=(MLP,),
                     mesh=ctx.mesh())
    _train_parity(ctx, impl, ref, model, spec, 10, calls)


# The deadline tells a hang from an error, as below: an engine that leaves padding to the hook may
# fail the unpadded cells on the short ranks only and leave the others in the all-gather (F11).
@distributed(world_size=[2, 3, 4], timeout=10)
@pytest.mark.parametrize("inputs", ["padded", "local_rows"])
@pytest.mark.parametrize("rows", [3, 5])
def test_uneven_shards(ctx, impl, rows, inputs):
    """A TwoTensor parameter whose dim 0 does not divide by the world size: the pre hook returns
    inputs padded to ceil(rows / shards), or the rank's own rows (fewer, or none, on the last
    ranks), which the engine must pad to the common row count itself before the all-gather."""
    calls = {"pre": 0, "post": 0}
    cls = _two_tensor_cls("5", calls, pad=inputs == "padded")
    with ctx.seeded(7):
        plain = nn.Sequential(nn.Linear(8, rows, bias=False), nn.ReLU(), nn.Linear(rows, 8, bias=False))
    ref = _to_two_tensor(copy.deepcopy(plain), TwoTensor).to(ctx.device)
    model = _to_two_tensor(plain, cls).to(ctx.device)
    _train_parity(ctx, impl, ref, model, ShardSpec(mesh=ctx.mesh()), 3, calls)


# The deadline is what tells a hang from an error: the cell takes a small fraction of it on the
# reference and on FSDP2 (docs/speed.md), so 5 s is ample, and an implementation that hangs (F11) costs 5 s.
@distributed(world_size=[2, 4], timeout=5)
@pytest.mark.parametrize("wrong_on", ["last_rank", "every_rank"])
def test_wrong_size_raises_on_every_rank(ctx, impl, wrong_on):
    """A pre hook returning too many rows must raise on EVERY rank; none may hang in the all-gather."""
    calls = {"pre": 0, "post": 0}
    bad_rank = ctx.world_size - 1 if wrong_on == "last_rank" else ctx.rank
    cls = _two_tensor_cls("5", calls, wrong_size_on=bad_rank)
    with ctx.seeded(7):
        plain = nn.Sequential(nn.Linear(8, 3, bias=False), nn.ReLU(), nn.Linear(3, 8, bias=False))
    with ctx.seeded(1):
        inp = torch.randn(2, 8, device=ctx.device)
    # Control: the same model with correctly sized inputs runs, so the error below is the size's.
    good = impl.shard(_to_two_tensor(copy.deepcopy(plain), _two_tensor_cls("5", {"pre": 0, "post": 0})).to(ctx.device),
                      ShardSpec(mesh=ctx.mesh()))
    good(inp).sum().backward()
    model = impl.shard(_to_two_tensor(plain, cls).to(ctx.device), ShardSpec(mesh=ctx.mesh()))
    with pytest.raises(Exception) as info:
        model(inp).sum().backward()
    assert calls["pre"] > 0, "the pre hook never ran"
    # The error must say what is wrong (not any exception: a crash elsewhere is not a size check).
    assert re.search(r"(?i)size|shape|numel|rows|pad", str(info.value)), \
        f"{type(info.value).__name__} does not name the wrongly sized all-gather inputs: {str(info.value)[:300]}"
    ctx.record("raised", {"what": "raised", "type": type(info.value).__name__, "msg": str(info.value)[:200]})


@distributed(world_size=[2, 4])
@pytest.mark.parametrize("signature", ["5", "legacy"])
@pytest.mark.parametrize("reshard_after_forward", [True, False])
@pytest.mark.requires("meta_init", "mixed_precision")
def test_meta_init_end_to_end(ctx, impl, reshard_after_forward, signature):
    """Seed: build on meta, shard with param_dtype=bf16, to_empty(), init, 3 steps; the post hook
    must be handed bf16. The seed's hooks take `(self, mesh)` ("legacy"); the 5-argument form too.
    Not only "no error": what each rank initialised in its shard is what the all-gather delivers,
    the first loss is the unsharded bf16 forward of those values, and training moves them."""
    calls = {"pre": 0, "post": 0}
    cls = _two_tensor_cls(signature, calls)
    model = _to_two_tensor(_mlp_stack(meta=True), cls)
    assert all(p.device == torch.device("meta") for p in model.parameters())
    spec = ShardSpec(strategy="FULL_SHARD" if reshard_after_forward else "SHARD_GRAD_OP", units=(MLP,),
                     mesh=ctx.mesh(),
                     mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
    model = impl.shard(model, spec)
    model.to_empty(device=ctx.device)
    with ctx.seeded(100 + ctx.rank):  # every rank draws its OWN values: the full tensor is their concatenation
        for p in model.parameters():  # into its own rows (DTensor's random ops on CUDA broadcast a seed)
            nn.init.trunc_normal_(local_part(p))
    local = {n: _split({n: t}, {n: t})[0] for n, t in impl.local_shards(model).items()}
    gathered = [None] * ctx.world_size
    dist.all_gather_object(gathered, {n: {k: v.detach().cpu() for k, v in d.items()} for n, d in local.items()},
                           group=ctx.group)
    init = impl.full_params(model)
    for name, full in _split(init, init)[0].items():
        base = name.rsplit(".", 1)[0] if name.endswith((".a", ".b")) else name
        parts = [g[base][name] for g in gathered]
        expected = torch.cat(parts)[: full.shape[0]]
        assert torch.equal(full.detach().cpu(), expected), f"{name}: the all-gathered parameter is not the ranks' initialised shards"
    ref = _to_two_tensor(_mlp_stack(), TwoTensor).to(ctx.device)
    with torch.no_grad():
        for n, p in ref.named_parameters():
            p.copy_(init[n])
    ref = ref.to(torch.bfloat16)
    calls.pop("param_dtypes", None)  # full_params may all-gather through the hooks in float32: count training only
    optim = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
    with ctx.seeded(42 + ctx.rank + 1):
        inp = torch.randn((2, 8), device=ctx.device)
    for it in range(3):
        loss = model(inp).sum()
        if it == 0:
            assert_close(ctx, *_split({"loss": loss}, {"loss": ref(inp.to(torch.bfloat16)).sum()}), "first loss vs unsharded bf16")
        loss.backward()
        optim.step()
        optim.zero_grad()
    assert torch.isfinite(loss).all(), f"loss {loss}"
    assert calls["pre"] > 0 and calls["post"] > 0, f"all-gather hooks never ran: {calls}"
    assert calls.get("param_dtypes") == {str(torch.bfloat16)}, f"post hook got {calls.get('param_dtypes')}"
    params = impl.full_params(model)
    assert all(not p.is_meta for p in params.values())
    for name, (a, b) in zip(_split(params, params)[0], zip(_split(params, params)[0].values(), _split(init, init)[0].values())):
        assert not torch.equal(a, b), f"{name}: unchanged by 3 Adam steps"


def _round_bf16(model: nn.Module, inp: torch.Tensor) -> torch.Tensor:
    """The unsharded reference of the monkey-patched model: weights round-tripped through bf16 in
    forward, gradients straight through to the fp32 weights (what the hooks do)."""
    params = {n: p + (p.to(torch.bfloat16).to(p.dtype) - p).detach() for n, p in model.named_parameters()}
    return torch.func.functional_call(model, params, (inp,))


@distributed(world_size=[2, 4])
@pytest.mark.parametrize("signature", ["5", "legacy"])
@pytest.mark.requires("meta_init")
def test_monkey_patch(ctx, impl, signature):
    """Seed (updated for torch 2.13, FINDINGS F7): hooks bound onto the plain local shards after
    to_empty() all-gather bf16 and cast back; the model trains like an unsharded one whose weights
    are rounded to bf16 in forward."""
    calls = {"pre": 0, "post": 0}

    def pre5(self, mesh, outer_size, outer_stride, module, mp_policy):
        calls["pre"] += 1
        return (self.to(torch.bfloat16),), None

    def pre_legacy(self, mesh):
        calls["pre"] += 1
        return (self.to(torch.bfloat16),), None

    @torch.no_grad()
    def post(self, outputs, metadata, param_dtype, *, out=None):
        calls["post"] += 1
        (tensor,) = outputs
        assert metadata is None, f"{metadata}"
        assert tensor.dtype == torch.bfloat16, f"{tensor.dtype}"
        if out is not None:
            with torch.autograd.grad_mode._unsafe_preserve_version_counter(out):
                out.copy_(tensor)
            return None
        return tensor.to(param_dtype), (tensor,)

    model = impl.shard(_mlp_stack(meta=True), ShardSpec(units=(MLP,), mesh=ctx.mesh()))
    model.to_empty(device=ctx.device)
    with ctx.seeded(0):
        for p in model.parameters():  # its own rows (DTensor's random ops on CUDA broadcast a seed)
            nn.init.trunc_normal_(local_part(p))
    ref = _mlp_stack().to(ctx.device)
    with torch.no_grad():  # before patching: the hooks' bf16 view is not the parameters' value
        for n, p in impl.full_params(model).items():
            ref.get_parameter(n).copy_(p)
    shards = impl.local_shards(model)
    assert sum("weight" in n for n in shards) > 0
    for name, local in shards.items():
        if "weight" in name:
            local.fsdp_pre_all_gather = types.MethodType(pre5 if signature == "5" else pre_legacy, local)
            local.fsdp_post_all_gather = types.MethodType(post, local)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
    ref_optim = torch.optim.Adam(ref.parameters(), lr=1e-2, foreach=True)
    with ctx.seeded(42 + ctx.rank + 1):
        inp = torch.randn((2, 8), device=ctx.device)
    for it in range(3):
        losses = [_round_bf16(ref, inp).sum(), model(inp).sum()]
        for loss in losses:
            loss.backward()
        _average_grads(ctx, ref)
        assert_close(ctx, losses[1], losses[0], f"loss it{it}")
        assert_close(ctx, impl.full_grads(model), {n: p.grad for n, p in ref.named_parameters()}, f"grads it{it}")
        for o in (ref_optim, optim):
            o.step()
            o.zero_grad()
    assert calls["pre"] > 0 and calls["post"] > 0, f"monkey-patched hooks never ran: {calls}"
    ctx.record("hook_calls", calls)
