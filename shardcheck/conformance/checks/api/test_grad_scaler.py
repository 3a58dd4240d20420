"""Sharded grad scaler (seed 001: torch's test_fsdp_sharded_grad_scaler.py).

* The scaler's unit checks (scale nested outputs, unscale sparse gradients, an inf gradient skips
  the optimizer step), run through `impl.grad_scaler(...)` on the ranks with the scaler's device
  following ctx.device. torch's ShardedGradScaler silently disables itself when its default
  device="cuda" is unavailable (FINDINGS F3), and a disabled scaler passes some of these checks
  vacuously: every check asserts `is_enabled()` and that the scaler actually changed something.
* Parity with unsharded training + torch.amp.GradScaler over the seed's 16 configs
  (offload x strategy x fp16 mixed precision x model; the seed ties the model to use_orig_params,
  which is FSDP1's own knob and here the `torch-fsdp1[flat]` variant).
* found_inf agreed across ranks: an inf in one rank's gradient only makes every rank skip the step
  and back off the scale identically.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from shardcheck.conformance.protocol import MixedPrecision, ShardSpec
from shardcheck.harness import device_guard
from shardcheck.conformance.checks.support.compare import assert_close
from shardcheck.conformance.protocol.capabilities import of_strategy
from shardcheck.conformance.checks.support.dp_reference import average_gradients_
from shardcheck.conformance.checks.support.grad_scaler import (
    named_with_grad, state_dict_round_trip, without_key_bias,
)
from shardcheck.conformance.checks.support.models import NestedWrappedModule, NonUniformReqGradNWM, TransformerWithSharedParams, unit_paths
from shardcheck.conformance.checks.support.tensors import local_part
from shardcheck.harness import distributed



def _scaler(impl, ctx, **kwargs):
    scaler = impl.grad_scaler(device=ctx.device.type, process_group=ctx.group, **kwargs)
    assert scaler.is_enabled(), f"{type(scaler).__name__} is disabled (device={ctx.device.type}): see FINDINGS F3"
    return scaler


# ---------------------------------------------------------------------------------------------
# Unit checks of one scaler (seed: TestShardGradScaler). The seed uses a 1-rank dummy group; here
# every rank of a 2-rank group runs them (the step check then also exercises the found_inf sync).
# ---------------------------------------------------------------------------------------------

@distributed(world_size=[2, 4])
@pytest.mark.requires("sharded_grad_scaler")
def test_grad_scaling(ctx, impl):
    scaler = _scaler(impl, ctx, init_scale=2.0)
    t0 = torch.full((1,), 4.0, dtype=torch.float32, device=ctx.device)
    t1 = torch.full((1,), 8.0, dtype=torch.float32, device=ctx.device)
    outputs = scaler.scale([t1.clone(), (t0.clone(), t1.clone()), [t0.clone(), t1.clone()]])
    assert isinstance(outputs, list) and isinstance(outputs[1], tuple) and isinstance(outputs[2], list)
    assert outputs[0].item() == 16.0 and outputs[1][0].item() == 8.0 and outputs[1][1].item() == 16.0, outputs
    assert outputs[2][0].item() == 8.0 and outputs[2][1].item() == 16.0, outputs
    assert scaler._scale.device == t1.device, (scaler._scale.device, t1.device)


@distributed(world_size=[2, 4])
@pytest.mark.requires("sharded_grad_scaler")
def test_scaling_unscaling_sparse(ctx, impl):
    dev = ctx.device
    scaler = _scaler(impl, ctx, init_scale=2.0)
    inv_scale = torch.full((1,), 0.5, dtype=torch.float, device=dev)
    found_inf = torch.full((1,), 0, dtype=torch.float, device=dev)

    # finite sparse gradient: unscaled in place, no inf
    i = torch.tensor([[0, 1, 1], [2, 0, 2]], device=dev, dtype=torch.int64)
    v = torch.tensor([16.0, 32.0, 64.0], dtype=torch.float, device=dev)
    s = torch.sparse_coo_tensor(i, v, torch.Size([2, 3]), device=dev, dtype=torch.float)
    s1 = s.clone()
    s1.grad = s.clone()
    opt = torch.optim.SGD([s1], lr=1.0)
    found_inf.zero_()
    found = scaler._unscale_grads_(opt, inv_scale, found_inf, True)[s1.device]  # allow_fp16: positional in every GradScaler
    assert found.item() == 0.0, found
    assert_close(ctx, s1.grad.to_dense(), (s / 2).to_dense(), "sparse grad unscaled")

    # a sparse gradient holding inf
    v = torch.tensor([16.0, 32.0, float("inf")], dtype=torch.float, device=dev)
    s1.grad = torch.sparse_coo_tensor(i, v, torch.Size([2, 3]), device=dev, dtype=torch.float)
    found_inf.zero_()
    found = scaler._unscale_grads_(opt, inv_scale, found_inf, True)[s1.device]  # allow_fp16: positional in every GradScaler
    assert found.item() == 1.0, found

    # fp16 sparse gradient whose duplicate indices overflow when coalesced (2**15 + 2**15 > 65504)
    i = torch.tensor([[1, 1, 1], [0, 0, 2]], device=dev, dtype=torch.int64)
    v = torch.tensor([2**15, 2**15, 1.0], dtype=torch.float16, device=dev)
    # SEED FINDING (seed 001, test_scaling_unscaling_sparse): the seed rebinds `s1` here but keeps
    # unscaling `opt`, which still holds the FIRST s1, whose grad is the inf gradient of the previous
    # sub-case: found_inf == 1 came from that leftover inf, never from fp16 overflow, so a scaler that
    # cannot detect an overflow on coalescing passed. Here the fp16 tensor gets its own optimizer.
    s2 = torch.sparse_coo_tensor(i, v, torch.Size([2, 3]), device=dev, dtype=torch.float16)
    s2.grad = s2.clone()
    assert torch.isfinite(s2.grad._values()).all()  # every stored value is finite: only coalescing overflows
    opt16 = torch.optim.SGD([s2], lr=1.0)
    found_inf.zero_()
    found = scaler._unscale_grads_(opt16, inv_scale, found_inf, True)[s2.device]  # allow_fp16: positional in every GradScaler
    assert found.item() == 1.0, f"fp16 sparse gradient overflowing on coalescing (2**15 + 2**15) not detected: {found}"
    # and the finite fp16 sparse gradient (no duplicate indices) does not report inf
    s3 = torch.sparse_coo_tensor(torch.tensor([[0, 1], [0, 2]], device=dev), torch.tensor([2.0**14, 1.0], dtype=torch.float16, device=dev),
                                 torch.Size([2, 3]), device=dev, dtype=torch.float16)
    s3.grad = s3.clone()
    found_inf.zero_()
    found = scaler._unscale_grads_(torch.optim.SGD([s3], lr=1.0), inv_scale, found_inf, True)[s3.device]
    assert found.item() == 0.0, f"finite fp16 sparse gradient reported inf: {found}"
    assert_close(ctx, s3.grad.to_dense().float(), torch.tensor([[2.0**13, 0, 0], [0, 0, 0.5]], device=dev), "fp16 sparse grad unscaled")


@distributed(world_size=[2, 4])
@pytest.mark.requires("sharded_grad_scaler")
def test_inf_gradients_skip_optim_step(ctx, impl):
    scaler = _scaler(impl, ctx, init_scale=2.0)
    loss = torch.full((1,), 4.0, dtype=torch.float32, device=ctx.device)
    t0 = torch.tensor([float("inf")], dtype=torch.float32, device=ctx.device)
    t0.grad = t0.clone()
    opt = torch.optim.SGD([t0], lr=1.0)
    scaled = scaler.scale(loss)
    assert scaled.item() == 8.0, scaled  # the scaler is really scaling
    ret_val = scaler.step(opt)
    assert ret_val is None, ret_val
    # Not vacuous: SGD would have turned inf into nan (inf - 1.0 * inf/2) had the step run.
    assert t0.item() == float("inf"), t0
    scaler.update()
    assert scaler.get_scale() == 1.0, scaler.get_scale()  # backed off by 0.5


# ---------------------------------------------------------------------------------------------
# Parity with unsharded training (seed: test_fsdp_ddp_parity_with_grad_scaler)
# ---------------------------------------------------------------------------------------------
# The seed loops over CUDAInitMode, where the model lives when it is sharded: CUDA_BEFORE (moved to
# the device, then sharded), CUDA_AFTER (sharded on the CPU, then moved) and, with CPU offload only,
# CUDA_NEVER (never moved). Each is its own cell here (`init`: device_before / device_after /
# device_never). CUDA_AFTER with offload must RAISE (an offloaded module whose parameters were moved
# to the device). On a CPU-only machine the device IS the CPU, so device_after / device_never are the
# same run as device_before and the expected error cannot arise: those cells are generated and skip
# with that reason; they run where ctx.device is an accelerator.
# After every step the seed's parity helper saves the state_dict, zeroes the parameters and loads it
# back (`_train_for_several_steps(save_model=True)`): a broken save/load breaks parity. Done here too.

INIT_MODES = ("device_before", "device_after", "device_never")
PARITY_CONFIGS = [(offload, strategy, mp, model, init)
                  for offload, strategy, mp, model in itertools.product([True, False], ["SHARD_GRAD_OP", "FULL_SHARD"],
                                                                         ["fp16", None], ["nonuniform", "nested"])
                  for init in INIT_MODES if init != "device_never" or offload]


def _parity_id(cfg):
    offload, strategy, mp, model, init = cfg
    return "-".join([f"offload_{str(offload).lower()}", strategy.lower(),
                     "mixed_precision" if mp else "full_precision", model, init])


def _parity_caps(params):
    caps = {"sharded_grad_scaler", "nested_units", of_strategy(params["strategy"])}
    if params["offload"]:
        caps.add("cpu_offload")
    if params["mp"]:
        caps.add("mixed_precision")
    if params["model_kind"] == "nonuniform":  # frozen by parameter name after sharding, as the seed
        caps.add("orig_params")
    return caps


PARITY_STEPS = 5


# World size 2 (the seed's) for the whole matrix; world size 4 for the full-precision configs
# (test_fsdp_ddp_parity_with_grad_scaler_ws4). Why not fp16 at 4: the fp16 reference emulates the
# reduction exactly (pre-divide, fp16 sum, post-divide), but the ORDER in which an implementation sums
# 4 fp16 gradients is its own choice (a ring, a tree, reduce-scatter vs all-reduce: on the threaded
# group the reference_impl's reduce-scatter and the check's all_reduce already differ by fp16 ulps at
# 4 ranks), and fp16 rounding makes the result depend on it. With 2 ranks a sum is one addition,
# which IEEE makes order-independent, so the comparison is exact whatever the implementation does.
@distributed(world_size=2)
@pytest.mark.requires.with_args(_parity_caps)
@pytest.mark.parametrize("offload,strategy,mp,model_kind,init", PARITY_CONFIGS, ids=[_parity_id(c) for c in PARITY_CONFIGS])
def test_fsdp_ddp_parity_with_grad_scaler(ctx, impl, offload, strategy, mp, model_kind, init):
    """Seed: use_orig_params=True trains NonUniformReqGradNWM (some ranks own no trainable shard)
    with init_scale 2**11; use_orig_params=False trains NestedWrappedModule with the default scale
    2**16. SGD(lr=0.01, momentum=0.9) on `output.sum()`, per-rank inputs. Here the model is the axis
    (`nonuniform` / `nested`); flat parameters are the `torch-fsdp1[flat]` variant's business.

    fp16 reference (FINDINGS F4: CPU autocast is not CUDA autocast, and the seed's autocast
    reference computes matmuls in fp16 but keeps fp32 gradients, which is not what
    MixedPrecision(fp16, fp16, fp16) does): the unsharded reference runs an fp16 copy of the weights
    (copied from fp32 master weights before every forward, as the sharded side casts its fp32 shards
    before the all-gather), on fp16-cast inputs; its fp16 gradients are averaged in fp16 with torch's
    pre/post division, cast to fp32 onto the master weights, which torch.amp.GradScaler unscales and
    SGD updates. That is exactly MixedPrecision(param=reduce=buffer=fp16) semantics, so overflow
    (found_inf -> skipped step, scale backed off) happens on the same steps on both sides.
    """
    _parity_body(ctx, impl, offload, strategy, mp, model_kind, init)


PARITY_CONFIGS_FP32 = [c for c in PARITY_CONFIGS if c[2] is None]


@distributed(world_size=4)
@pytest.mark.requires.with_args(_parity_caps)
@pytest.mark.parametrize("offload,strategy,mp,model_kind,init", PARITY_CONFIGS_FP32,
                         ids=[_parity_id(c) for c in PARITY_CONFIGS_FP32])
def test_fsdp_ddp_parity_with_grad_scaler_ws4(ctx, impl, offload, strategy, mp, model_kind, init):
    """The full-precision configs of the parity above at world size 4 (fp16: see the note above)."""
    _parity_body(ctx, impl, offload, strategy, mp, model_kind, init)


def _parity_body(ctx, impl, offload, strategy, mp, model_kind, init):
    # Under the device guard (harness/device_guard.py) the CPU stands in for the accelerator: a model
    # built on the host and sharded (device_never) must still compute on the rank's device. Moving an
    # offloaded model to the device (device_after) is no move on the CPU: that cell needs an accelerator.
    on_accelerator = ctx.device.type != "cpu" or (device_guard.active() and not (offload and init == "device_after"))
    if init != "device_before" and not on_accelerator:
        pytest.skip(f"{init}: where the model lives when sharded (seed CUDAInitMode) only differs from "
                    f"device_before with an accelerator; this run's device is the CPU")
    build_device = ctx.device if init == "device_before" else None  # None: on the host, as the seed builds
    mp_dtype = torch.float16 if mp == "fp16" else None
    nonuniform = model_kind == "nonuniform"
    model_cls = NonUniformReqGradNWM if nonuniform else NestedWrappedModule
    init_scale = 2.0**11 if nonuniform else 2.0**16
    with ctx.seeded(0):
        # freeze=False: the seed freezes NonUniformReqGradNWM after wrapping; do the same below
        kw = {"freeze": False} if nonuniform else {}
        model = model_cls(ctx.rank, ctx.world_size, deterministic=True, device=build_device, **kw)
    ref = copy.deepcopy(model).to(ctx.device)
    # The seed's MixedPrecision(param=reduce=buffer=fp16). Both models have no buffers, so buffer_dtype
    # changes nothing; it is left None so that implementations without buffer_dtype (FSDP2) run too.
    assert not list(model.buffers())
    spec = ShardSpec(strategy=strategy, units=unit_paths(model), offload=offload, mesh=ctx.mesh(),
                     mixed_precision=MixedPrecision(mp_dtype, mp_dtype) if mp_dtype else None)
    model = impl.shard(model, spec)
    if init == "device_after":  # seed CUDA_AFTER: moved to the device after sharding
        if offload:  # the seed expects an error: offloaded parameters must stay on the CPU
            with pytest.raises(RuntimeError, match="(?i)offload"):
                model.to(ctx.device)
                with ctx.seeded(0):
                    (inp,) = ref.get_input(ctx.device)
                model(inp).sum().backward()
            return
        model = model.to(ctx.device)
    if nonuniform:
        NonUniformReqGradNWM.set_nonuniform_req_grad(model)  # like the seed: after sharding
        NonUniformReqGradNWM.set_nonuniform_req_grad(ref)
        for m in (ref, model):
            assert any(p.requires_grad for p in m.parameters()) and not all(p.requires_grad for p in m.parameters())
    low = copy.deepcopy(ref).to(mp_dtype) if mp_dtype else ref  # the reference's compute copy

    optim = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    ref_optim = torch.optim.SGD(ref.parameters(), lr=0.01, momentum=0.9)
    scaler = _scaler(impl, ctx, init_scale=init_scale)
    ref_scaler = torch.amp.GradScaler(ctx.device.type, init_scale=init_scale)
    assert ref_scaler.is_enabled()

    steps_taken = 0
    for step in range(PARITY_STEPS):
        with ctx.seeded(step):
            (inp,) = ref.get_input(ctx.device)  # seeds 1 + rank: different data on every rank
        if mp_dtype:
            with torch.no_grad():
                for lp, p in zip(low.parameters(), ref.parameters()):
                    lp.copy_(p)
        optim.zero_grad()
        ref_optim.zero_grad()
        low.zero_grad()

        loss = model(inp).sum()
        ref_loss = low(inp.to(mp_dtype) if mp_dtype else inp).sum()
        assert loss.dtype == (mp_dtype or torch.float32), loss.dtype
        assert_close(ctx, loss, ref_loss, f"loss step {step}")
        scaler.scale(loss).backward()
        ref_scaler.scale(ref_loss).backward()
        average_gradients_([p.grad for p in low.parameters()], ctx.group, predivide=True)
        if mp_dtype:
            for lp, p in zip(low.parameters(), ref.parameters()):
                p.grad = None if lp.grad is None else lp.grad.float()

        scale = scaler.get_scale()
        assert scale == ref_scaler.get_scale(), (scale, ref_scaler.get_scale())
        scaler.step(optim)
        scaler.update()
        ref_scaler.step(ref_optim)
        ref_scaler.update()
        assert scaler.get_scale() == ref_scaler.get_scale(), f"step {step}: scale {scaler.get_scale()} != reference {ref_scaler.get_scale()}"
        steps_taken += scaler.get_scale() >= scale
        for p in model.parameters():
            assert local_part(p).device.type == ("cpu" if offload else ctx.device.type), p.device
        state_dict_round_trip(model)
        assert_close(ctx, impl.full_params(model), dict(ref.named_parameters()), f"params after step {step} "
                     "(state_dict saved, parameters zeroed, state_dict loaded)")
    ctx.assert_equal_across_ranks(scaler.get_scale(), "scale")
    ctx.record("steps_taken", steps_taken)
    # Not vacuous: at least one step was not skipped for overflow, so the params really moved.
    assert steps_taken >= 1, f"every step of {PARITY_STEPS} found inf"


# ---------------------------------------------------------------------------------------------
# found_inf agreed across ranks (seed: test_sharded_grad_scaler_found_inf)
# ---------------------------------------------------------------------------------------------

FOUND_INF_ITERS = 4  # the seed runs 10; an inf on even iterations, none on odd ones


def _found_inf_caps(params):
    return {"sharded_grad_scaler", "nested_units", "full_shard"} | ({"cpu_offload"} if params["offload"] else set())


@distributed(world_size=[2, 4])
@pytest.mark.requires.with_args(_found_inf_caps)
@pytest.mark.parametrize("offload", [True, False], ids=["offload_true", "offload_false"])
def test_sharded_grad_scaler_found_inf(ctx, impl, offload):
    """TransformerWithSharedParams (units: encoder/decoder layers), Adam(lr=1e-2), init_scale 2.
    On even iterations rank 0 alone writes inf into its first gradient: every rank must skip the
    step (its local parameters unchanged) and back off the scale; the reference (unsharded, grads
    averaged, inf on every rank) does the same. Losses and parameters match it at every iteration."""
    with ctx.seeded(0):
        model = TransformerWithSharedParams(ctx.rank, ctx.world_size, deterministic=True, device=ctx.device)
    ref = copy.deepcopy(model)
    model = impl.shard(model, ShardSpec(strategy="FULL_SHARD", units=unit_paths(model), offload=offload))
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_optim = torch.optim.Adam(ref.parameters(), lr=1e-2)
    scaler = _scaler(impl, ctx, init_scale=2.0)
    ref_scaler = torch.amp.GradScaler(ctx.device.type, init_scale=2.0)

    for it in range(FOUND_INF_ITERS):
        should_find_inf = it % 2 == 0
        with ctx.seeded(42 + ctx.rank + 1):
            inp = ref.get_input(ctx.device)
        scaled = {}
        for name, m, opt, sc in (("reference", ref, ref_optim, ref_scaler), ("sharded", model, optim, scaler)):
            opt.zero_grad()
            loss = ref.get_loss(inp, m(*inp))
            scaled[name] = sc.scale(loss)
            scaled[name].backward()
            if m is ref:
                average_gradients_([p.grad for p in ref.parameters()], ctx.group, predivide=True)
            with_grad = [p for p in m.parameters() if p.grad is not None]
            before = [local_part(p).detach().clone() for p in with_grad]
            if should_find_inf and (m is ref or ctx.rank == 0):
                # the other ranks must learn about rank 0's inf from the scaler's found_inf sync
                local_part(with_grad[0].grad).fill_(float("inf"))
            orig_scale = sc.get_scale()
            sc.step(opt)
            sc.update()
            if should_find_inf:
                assert sc.get_scale() == orig_scale * sc.get_backoff_factor(), \
                    f"{name} it {it}: scale {sc.get_scale()} not backed off from {orig_scale}"
                for p, b in zip(with_grad, before):
                    assert torch.equal(local_part(p).detach(), b), f"{name} rank {ctx.rank} it {it}: stepped despite inf"
            else:
                assert sc.get_scale() == orig_scale, f"{name} it {it}: scale {sc.get_scale()} != {orig_scale}"
                # torch's test requires EVERY parameter to change on a finite step (Adam moves every
                # parameter whose gradient is nonzero). Empty local shards have nothing to change.
                for (pname, p), b in zip(named_with_grad(m), before):
                    if b.numel() and torch.count_nonzero(local_part(p.grad)):
                        assert not torch.equal(local_part(p).detach(), b), \
                            f"{name} rank {ctx.rank} it {it}: {pname} unchanged on a finite step"
        ctx.assert_equal_across_ranks(scaler.get_scale(), f"scale after it {it}")
        assert_close(ctx, scaled["sharded"], scaled["reference"], f"scaled loss it {it}")
        assert_close(ctx, without_key_bias(impl.full_params(model)), without_key_bias(dict(ref.named_parameters())),
                     f"params after it {it}")
