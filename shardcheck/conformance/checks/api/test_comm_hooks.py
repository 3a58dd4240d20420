"""Gradient communication hooks (seed 004: torch's test_fsdp_comm_hooks.py).

A hook replaces a unit's gradient collective (FSDP1's `register_comm_hook` contract):
NO_SHARD calls `hook(state, grad)`, which leaves the averaged gradient in `grad`; sharded
strategies call `hook(state, grad, output)`, which writes this rank's averaged shard into `output`.
Hooks are registered on the root only, once, and apply to every unit.

* default behaviour: Linear(1, ws) fed `rank` gets the mean over ranks without any hook;
* registration: none by default, root registration reaches every unit, a second registration, a
  registration on a non-root unit, and a root registration while a sub-unit already holds a hook raise;
* a counting custom hook is really called, and its result is really used;
* the implementation's fp16/bf16 compression hooks equal MixedPrecision(reduce_dtype=...).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from shardcheck.compat import reduce_scatter_single
from shardcheck.conformance.protocol import MixedPrecision, ShardSpec
from shardcheck.conformance.checks.support.comm_hooks import plant_comm_hook
from shardcheck.conformance.checks.support.compare import assert_close
from shardcheck.conformance.checks.support.dp_reference import all_reduce_coalesced_
from shardcheck.conformance.protocol.capabilities import of_strategy
from shardcheck.conformance.checks.support.models import Net, unit_paths
from shardcheck.conformance.checks.support.tensors import local_part
from shardcheck.harness import distributed

STRATEGIES = ["NO_SHARD", "FULL_SHARD", "SHARD_GRAD_OP"]
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _caps(params) -> set[str]:
    caps = {"comm_hooks", of_strategy(params["strategy"])}
    if params.get("has_wrapping", False):
        caps.add("nested_units")
    if "dtype" in params:
        caps |= {"compression_hooks", "mixed_precision"}
    return caps


def _build_net(ctx, impl, has_wrapping: bool, strategy: str, mixed_precision=None):
    """The seed's Net: `net.2` and `net` are their own units when has_wrapping, then the root; every
    unit with the same strategy and mixed precision. Returns (sharded root, unsharded copy, #units)."""
    with ctx.seeded(0):
        model = Net(has_wrapping=has_wrapping).to(ctx.device)
    ref = copy.deepcopy(model)
    units = unit_paths(model)
    sharded = impl.shard(model, ShardSpec(strategy=strategy, units=units, mixed_precision=mixed_precision))
    return sharded, ref, len(units) + 1  # and the root


def _assert_no_hooks(impl, model, n_units: int) -> None:
    hooks = impl.comm_hooks(model)
    assert len(hooks) == n_units, f"comm_hooks lists {len(hooks)} units, the model has {n_units}"
    assert all(hook is None and state is None for hook, state in hooks), hooks


class DummyState:
    __slots__ = ["process_group", "noise"]

    def __init__(self, process_group, noise: int):
        self.process_group = process_group
        self.noise = noise


def dummy_hook_for_no_shard(state: DummyState, grad: torch.Tensor) -> None:
    """The seed's illustration hook (never run here: only registered)."""
    grad.add_(state.noise)
    dist.all_reduce(grad, group=state.process_group)


def dummy_hook_for_sharded(state: DummyState, grad: torch.Tensor, output: torch.Tensor) -> None:
    """The seed's illustration hook (never run here: only registered)."""
    grad.add_(state.noise)


def _dummy_hook(strategy: str):
    # The seed gives NO_SHARD the sharded hook and vice versa (harmless: only registration is
    # tested); here each strategy gets the hook of its own signature.
    return dummy_hook_for_no_shard if strategy == "NO_SHARD" else dummy_hook_for_sharded


# ---------------------------------------------------------------------------------------------

@distributed(world_size=[2, 4])
@pytest.mark.requires.with_args(_caps)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_default_communication_hook_behavior(ctx, impl, strategy):
    """Linear(1, ws, bias=False) fed x = rank: d(sum W x)/dW = rank in every element, so the averaged
    gradient is sum(range(ws)) / ws everywhere, on every rank's shard and in the full gradient."""
    ws = ctx.world_size
    with ctx.seeded(0):
        net = nn.Linear(1, ws, bias=False).to(ctx.device)
    inpt = torch.tensor([ctx.rank], dtype=torch.float32, device=ctx.device)
    model = impl.shard(net, ShardSpec(strategy=strategy))
    _assert_no_hooks(impl, model, 1)
    expected = sum(range(ws)) / ws
    for it in range(4):
        model.zero_grad()
        model(inpt).sum().backward()
        grads = [local_part(p.grad) for p in model.parameters() if p.grad is not None]
        assert grads, "no gradient after backward"
        for g in grads:
            if g.numel():  # the seed checks grad[0] of each rank's (flat) shard
                assert g.reshape(-1)[0].item() == expected, f"it {it}: hook grad {g.reshape(-1)[0].item()} != {expected}"
        assert_close(ctx, impl.full_grads(model), {"weight": torch.full((ws, 1), expected)}, f"grad it {it}")


@distributed(world_size=[2, 4])
@pytest.mark.requires.with_args(_caps)
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("has_wrapping", [True, False], ids=["wrapped", "root_only"])
def test_default_communication_hook_initialization(ctx, impl, has_wrapping, strategy):
    model, _, n_units = _build_net(ctx, impl, has_wrapping, strategy)
    _assert_no_hooks(impl, model, n_units)
    state, hook = DummyState(process_group=None, noise=1234), _dummy_hook(strategy)
    impl.register_comm_hook(model, state, hook)
    with pytest.raises(AssertionError, match="^A communication hook is already registered$"):
        impl.register_comm_hook(model, state, hook)
    hooks = impl.comm_hooks(model)
    assert len(hooks) == n_units, hooks
    for unit_hook, unit_state in hooks:  # the root's hook reached every unit
        assert unit_hook == hook and unit_state is state, (unit_hook, unit_state)


@distributed(world_size=[2, 4])
@pytest.mark.requires.with_args(lambda params: _caps({**params, "has_wrapping": True}))
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("when", ["after_forward", "before_forward"])
def test_registering_hook_non_root(ctx, impl, strategy, when):
    """`net.2` is never a root. The seed asks every unit `check_is_root()` root first before
    registering, which makes FSDP1 settle the roots; "after_forward" settles them the
    implementation-neutral way (one forward/backward through the root), "before_forward" registers
    on the fresh model (an implementation that decides roots lazily may wrongly accept it)."""
    model, ref, n_units = _build_net(ctx, impl, True, strategy)
    state, hook = DummyState(process_group=None, noise=1234), _dummy_hook(strategy)
    if when == "after_forward":
        with ctx.seeded(1 + ctx.rank):
            (x,) = ref.get_input(ctx.device)
        model(x).sum().backward()
    # The seed's submodules[1]: the non-root units in module order are `net`, `net.2`.
    with pytest.raises(AssertionError, match="^register_comm_hook can only be called on a root instance.$"):
        impl.register_comm_hook(model, state, hook, path="net.2")
    _assert_no_hooks(impl, model, n_units)  # a refused registration leaves nothing behind


@distributed(world_size=[2, 4])
@pytest.mark.requires.with_args(lambda params: _caps({**params, "has_wrapping": True}))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_registering_hook_submodules(ctx, impl, strategy):
    """Seed: a hook already sits on the non-root unit `net.2` (set directly, as the seed does with
    `submodules[1]._comm_hook`); registering on the root must refuse, since the root's hook would
    silently replace it: the root checks EVERY unit, not only itself. The planted hook stays."""
    model, _, n_units = _build_net(ctx, impl, True, strategy)
    state, hook = DummyState(process_group=None, noise=1234), _dummy_hook(strategy)
    plant_comm_hook(impl, model, "net.2", state, hook)
    hooks = impl.comm_hooks(model)
    assert sum(h is hook for h, _ in hooks) == 1, f"the planted hook is not on exactly one unit: {hooks}"
    with pytest.raises(AssertionError, match="^A communication hook is already registered$"):
        impl.register_comm_hook(model, state, hook)
    after = impl.comm_hooks(model)
    assert len(after) == n_units and any(h is hook and st is None for h, st in after), f"the planted hook is gone: {after}"


@distributed(world_size=[2, 4])
@pytest.mark.requires.with_args(lambda params: _caps({**params, "has_wrapping": True}))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_refused_registration_leaves_no_hook(ctx, impl, strategy):
    """Added to the seed's submodules case: a root registration refused because `net.2` holds a hook
    is all-or-nothing; no other unit (the root, `net`) is left with the hook or its state."""
    model, _, n_units = _build_net(ctx, impl, True, strategy)
    state, hook = DummyState(process_group=None, noise=1234), _dummy_hook(strategy)
    plant_comm_hook(impl, model, "net.2", state, hook)
    with pytest.raises(AssertionError, match="^A communication hook is already registered$"):
        impl.register_comm_hook(model, state, hook)
    after = impl.comm_hooks(model)
    assert len(after) == n_units and sum(h is hook for h, _ in after) == 1, f"refused registration changed hooks: {after}"
    assert all(st is None for _, st in after), f"refused registration left a state behind: {after}"


# ---------------------------------------------------------------------------------------------
# A custom hook: counted (a hook that is never called must be detected) and consumed (its output is
# what lands in the gradients).

class CountingState:
    def __init__(self, process_group, factor: float):
        self.process_group = process_group
        self.factor = factor
        self.calls = 0
        self.signatures = set()


def counting_hook(state: CountingState, grad: torch.Tensor, output: torch.Tensor | None = None) -> None:
    """The default behaviour (sum over ranks / world size: all-reduce for NO_SHARD, reduce-scatter
    into `output` otherwise), times `state.factor`, counting the calls."""
    state.calls += 1
    state.signatures.add("grad" if output is None else "grad,output")
    ws = dist.get_world_size(state.process_group)
    if output is None:
        dist.all_reduce(grad, group=state.process_group)
        grad.mul_(state.factor / ws)
    else:
        reduce_scatter_single(output, grad, group=state.process_group)
        output.mul_(state.factor / ws)


@distributed(world_size=[2, 4])
@pytest.mark.requires.with_args(lambda params: _caps({**params, "has_wrapping": True}))
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("factor", [1.0, 2.0], ids=["mean", "doubled"])
def test_custom_hook_called(ctx, impl, strategy, factor):
    """factor 1: the hook reproduces the default average (gradients equal the unsharded average);
    factor 2: the hook's result must be what the gradients hold (2x the average), so an
    implementation that calls the hook but then reduces again, or ignores it, fails."""
    model, ref, n_units = _build_net(ctx, impl, True, strategy)
    state = CountingState(ctx.group or dist.group.WORLD, factor)
    impl.register_comm_hook(model, state, counting_hook)
    for it in range(2):
        with ctx.seeded(1 + ctx.rank + 10 * it):  # different data on every rank
            (x,) = ref.get_input(ctx.device)
        model.zero_grad()
        ref.zero_grad()
        calls = state.calls
        loss, ref_loss = model(x).sum(), ref(x).sum()
        assert_close(ctx, loss, ref_loss, f"loss it {it}")
        loss.backward()
        ref_loss.backward()
        all_reduce_coalesced_([p.grad for p in ref.parameters()], ctx.group)
        for p in ref.parameters():
            p.grad.mul_(factor / ctx.world_size)
        # every unit has gradients, so each one's collective must have gone through the hook
        assert state.calls - calls >= n_units, f"it {it}: hook called {state.calls - calls} times for {n_units} units"
        assert_close(ctx, impl.full_grads(model), {n: p.grad for n, p in ref.named_parameters()}, f"grads it {it}")
    expected_sig = "grad" if strategy == "NO_SHARD" else "grad,output"
    assert state.signatures == {expected_sig}, state.signatures
    ctx.record("hook_calls", state.calls)


# ---------------------------------------------------------------------------------------------

@distributed(world_size=[2, 4])
@pytest.mark.requires.with_args(_caps)
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("has_wrapping", [True, False], ids=["wrapped", "root_only"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_low_precision_hook(ctx, impl, dtype, has_wrapping, strategy):
    """Seed test_fp16_hook / test_bf16_hook: the compression hook gives the same gradients as
    MixedPrecision(reduce_dtype=dtype), and leaves them in state.parameter_type. Unlike the seed
    (same input on every rank) each rank gets its own data, so the average is not trivial."""
    dt = DTYPES[dtype]
    state, hook = impl.compression_hook(dt)
    with_hook, _, _ = _build_net(ctx, impl, has_wrapping, strategy)
    impl.register_comm_hook(with_hook, state, hook)
    with_mp, _, _ = _build_net(ctx, impl, has_wrapping, strategy, MixedPrecision(reduce_dtype=dt))
    optim_hook = torch.optim.SGD(with_hook.parameters(), lr=0.1)
    optim_mp = torch.optim.SGD(with_mp.parameters(), lr=0.1)
    with ctx.seeded(1 + ctx.rank):
        in_data = torch.rand(16, 8, device=ctx.device)
    with_hook.train()
    with_mp.train()
    loss_hook = with_hook(in_data).sum()
    loss_mp = with_mp(in_data).sum()
    assert_close(ctx, loss_hook, loss_mp, "loss")
    loss_hook.backward()
    grads = [p.grad for p in with_hook.parameters() if p.grad is not None]
    assert grads, "no gradient after backward"
    for g in grads:  # the hook decompressed into the parameters' dtype
        assert g.dtype == state.parameter_type, (g.dtype, state.parameter_type)
    loss_mp.backward()
    optim_hook.step()
    optim_mp.step()
    got, expected = impl.full_grads(with_hook), impl.full_grads(with_mp)
    assert_close(ctx, got, expected, f"{dtype} hook grads vs MixedPrecision(reduce_dtype={dtype})")
    # Not vacuous: the gradients really travelled in `dt` (an fp32 reduce would not round them).
    for name, g in got.items():
        if g is not None:
            assert torch.equal(g, g.to(dt).to(g.dtype)), f"{name}: gradient not representable in {dtype}"
    assert_close(ctx, impl.full_params(with_hook), impl.full_params(with_mp), "params after step")
