"""The sharded GradScaler over gradients kept in low precision (family grad_scaler): FSDP1's
`keep_low_precision_grads=True` leaves float16 or bfloat16 gradients on the sharded parameters, and
the scaler's `unscale_` and `step` must take them as they are (fairscale#834: a scaler that refuses
"Attempting to unscale FP16 gradients"), find an inf on one rank's gradient on every rank, skip the
step everywhere and back off the scale.

The yardstick is unsharded training on a low-precision copy whose gradients are averaged in that
dtype (FSDP's pre- and post-division), unscaled in it (``g * (1 / scale)``, rounded once, as
torch's unscale kernel does) and stepped by SGD onto the float32 master parameters; GradScaler's
rule for the scale: back off by 1/2 on an inf anywhere, else grow after `growth_interval` steps.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from shardcheck.conformance.checks.support.compare import assert_close
from shardcheck.conformance.checks.support.dp_reference import average_gradients_
from shardcheck.conformance.checks.support.workloads import WORKLOADS
from shardcheck.conformance.protocol import MixedPrecision, ShardSpec
from shardcheck.harness import distributed

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
INIT_SCALE, STEPS, LR = 2.0 ** 6, 3, 0.05


def _scaled_low_step(ctx, low, master, batch, loss_fn, scale: float, dtype) -> tuple[torch.Tensor, bool]:
    """The yardstick's step: (loss, found_inf) after backward of loss * scale on `low`, gradients
    averaged and unscaled in `dtype`, set on `master` as float32 copies of those values (SGD adds a
    float16 gradient to a float32 parameter in float32 alike); stepped by the caller unless found_inf."""
    with torch.no_grad():
        for lp, p in zip(low.parameters(), master.parameters()):
            lp.copy_(p)
    low.zero_grad(set_to_none=True)
    x, y, poison = batch
    loss = loss_fn(low, (x.to(dtype), y, poison.to(dtype)))
    (loss * scale).backward()
    grads = [p.grad for p in low.parameters()]
    average_gradients_(grads, ctx.group, predivide=True)
    inv = torch.tensor(scale, dtype=torch.float64).reciprocal().float()
    found = torch.tensor([float(any(not torch.isfinite(g).all() for g in grads))], device=ctx.device)
    dist.all_reduce(found, op=dist.ReduceOp.MAX, group=ctx.group)
    for g, p in zip(grads, master.parameters()):
        p.grad = (g * inv).float()  # one rounding to float16 / bfloat16, then the exact float32 value
    return loss.detach(), bool(found.item())


@distributed(world_size=2)  # two ranks' low-precision sum is one addition: at 4 its order is the backend's
@pytest.mark.requires.with_args(lambda params: {"sharded_grad_scaler", "keep_low_precision_grads", "full_shard",
                                                "nested_units", f"mixed_precision_{params['dtype']}"})
@pytest.mark.parametrize("inf", ["finite", "inf_on_one_rank"])
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_low_precision_grads_through_the_scaler(ctx, impl, dtype, inf):
    """Three SGD steps of UnevenMLP with gradients kept in `dtype` (reduced in it too), scaled by
    the sharded GradScaler: the unscaled gradients, the skip, the scale and the parameters match the
    yardstick after every step. `inf_on_one_rank`: at step 1, rank 1's head-bias gradient alone is
    inf (the head's one row lives on rank 0's shard, so the other ranks see only finite shards)."""
    low_dtype, w = DTYPES[dtype], WORKLOADS["uneven_mlp"]
    with ctx.seeded(0):
        model = w.build().to(ctx.device)
    master = copy.deepcopy(model)
    low = copy.deepcopy(model).to(low_dtype)
    mp = MixedPrecision(param_dtype=low_dtype, reduce_dtype=low_dtype, keep_low_precision_grads=True)
    model = impl.shard(model, ShardSpec(strategy="FULL_SHARD", units=w.units, mesh=ctx.mesh(), mixed_precision=mp))
    # foreach=False: the per-parameter loop steps float32 parameters with low-precision gradients (as
    # FSDP's keep_low_precision_grads asks of "an optimizer that supports running in low precision");
    # CUDA's default multi-tensor SGD refuses a gradient whose dtype is not its parameter's
    optim = torch.optim.SGD(model.parameters(), lr=LR, foreach=False)
    ref_optim = torch.optim.SGD(master.parameters(), lr=LR, foreach=False)
    scaler = impl.grad_scaler(device=ctx.device.type, process_group=ctx.group, init_scale=INIT_SCALE)
    assert scaler.is_enabled(), f"{type(scaler).__name__} is disabled on {ctx.device.type}"
    ref_scale, skipped = INIT_SCALE, 0
    poison = {1: float("inf")} if inf == "inf_on_one_rank" else {}
    for step, batch in enumerate(w.batches(ctx, STEPS, poison)):
        optim.zero_grad(set_to_none=True)
        loss = w.loss_fn(model, batch)
        scaler.scale(loss).backward()
        ref_loss, found = _scaled_low_step(ctx, low, master, batch, w.loss_fn, ref_scale, low_dtype)
        assert_close(ctx, loss.float(), ref_loss.float(), f"step {step} loss", dtype=low_dtype)
        scaler.unscale_(optim)
        if not found:
            assert_close(ctx, impl.full_grads(model), {n: p.grad for n, p in master.named_parameters()},
                         f"step {step} unscaled {dtype} gradients", dtype=low_dtype)
        scaler.step(optim)
        scaler.update()
        if found:
            ref_scale, skipped = ref_scale * 0.5, skipped + 1
        else:
            ref_optim.step()
        assert scaler.get_scale() == ref_scale, (f"step {step}: scale {scaler.get_scale()} after update, expected "
                                                 f"{ref_scale} ({'an inf on some rank' if found else 'finite'})")
        assert_close(ctx, impl.full_params(model), dict(master.named_parameters()), f"step {step} parameters",
                     dtype=low_dtype)
    assert skipped == len(poison), f"{skipped} steps skipped, {len(poison)} poisoned"
    ctx.assert_equal_across_ranks(scaler.get_scale(), "scale")
