"""clip_grad_norm_ on the root sharded module (family clip_grad), from seed 003 (torch
test_fsdp_clip_grad_norm.py, FSDP1): non-root refusal, the DDP parity matrix, low-precision
gradients, no gradients; plus a total norm below max_norm, which must leave gradients unchanged.

The unsharded reference is a deepcopy whose gradients are all-reduced and averaged by hand; the
candidate is clipped through `impl.clip_grad_norm_` and compared through `impl.full_grads` /
`impl.full_params`.
"""

from __future__ import annotations

import copy


import pytest
import torch
import torch.nn as nn

from shardcheck.conformance.checks.support import models as M, shared_reference
from shardcheck.conformance.protocol import MixedPrecision, ShardSpec
from shardcheck.conformance.checks.support.compare import assert_close
from shardcheck.conformance.protocol.capabilities import of_strategy
from shardcheck.conformance.checks.support.dp_reference import average_gradients_
from shardcheck.conformance.checks.support.clip import INF, LR, assert_clipped, detached_copies, grads_of, norm_of, record_warnings, shard_spec_of
from shardcheck.conformance.checks.support.tensors import local_part
from shardcheck.harness import distributed

FAMILY = "clip_grad"

pytestmark = [
    pytest.mark.requires("clip_grad_norm"),
    # nn.Transformer (in TransformerWithSharedParams) warns about nested tensors; irrelevant here.
    pytest.mark.filterwarnings("ignore:enable_nested_tensor is True"),
]


# ---------------------------------------------------------------- seed 003: FSDP1-style clip


@distributed(world_size=[2, 4])
@pytest.mark.requires("full_shard", "nested_units")
def test_non_root(ctx, impl):
    """clip_grad_norm_ on a non-root unit is refused."""
    with ctx.seeded(0):
        model = M.TwoLinear().to(ctx.device)
        inp = torch.randn(2, 5, device=ctx.device)
    model = impl.shard(model, ShardSpec(units=("lin2",), mesh=ctx.mesh()))
    model(inp).sum().backward()
    with pytest.raises(RuntimeError, match="should only be called on the root"):
        impl.clip_grad_norm_unit_(model, "lin2", 2)


@distributed(world_size=[2, 4])
@pytest.mark.requires.with_args(lambda params: {of_strategy(params["strategy"]), "nested_units"})
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
@pytest.mark.parametrize("norm_type", [1.0, 2.0, INF])
def test_below_max_norm_leaves_grads_unchanged(ctx, impl, norm_type, strategy):
    """A total norm below max_norm clips nothing: the coefficient is clamped to 1 (torch's
    clip_grad_norm_ semantics), so gradients come back bit-identical and the norm is still right."""
    with ctx.seeded(0):
        ref_model = M.NestedWrappedModule(deterministic=True, device=ctx.device)
        model = copy.deepcopy(ref_model)
        inp = ref_model.get_input(ctx.device)
    model = impl.shard(model, shard_spec_of(model, strategy=strategy, mesh=ctx.mesh()))
    with ctx.seeded(1 + ctx.rank):
        inp = tuple(x + 0.1 * torch.randn_like(x) for x in inp)
    ref_model(*inp).sum().backward()
    average_gradients_([p.grad for p in ref_model.parameters()], ctx.group)
    model(*inp).sum().backward()
    before = detached_copies(impl.full_grads(model))
    ref_total = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), max_norm=1e6, norm_type=norm_type)
    total = impl.clip_grad_norm_(model, 1e6, norm_type)
    assert 0 < ref_total.item() < 1e6
    assert_close(ctx, total, ref_total, "total norm")
    after = detached_copies(impl.full_grads(model))
    for name, g in before.items():
        assert g is None or torch.equal(after[name], g), f"{name} changed although the norm is below max_norm"


LARGE_FACTOR = 100


def _ddp_parity_requires(params):
    needed = {"nested_units"}
    if params["strategy"] == "mixed_strategy":  # encoder NO_SHARD, decoder and root FULL_SHARD
        needed |= {"mixed_strategy", of_strategy("FULL_SHARD"), of_strategy("NO_SHARD")}
    else:
        needed.add(of_strategy(params["strategy"]))
    if params["offload"]:
        needed.add("cpu_offload")
    return needed


def _data_parallel_clip(ctx, max_norm, norm_type) -> dict:
    """The data-parallel side of test_ddp_parity, computed once for all its strategies and offload
    settings: the averaged gradients scaled by LARGE_FACTOR, before and after
    torch.nn.utils.clip_grad_norm_, the total norm, the parameters after one Adam step, then the total
    norms of three more iterations."""
    with ctx.seeded(0):
        ref_model = M.TransformerWithSharedParams(ctx.rank, ctx.world_size, deterministic=True, device=ctx.device)
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=LR)
    inputs = _inputs(ctx, ref_model)
    ref_model.get_loss(inputs[0], ref_model(*inputs[0])).backward()
    average_gradients_([p.grad for p in ref_model.parameters()], ctx.group)
    for p in ref_model.parameters():
        if p.grad is not None:
            p.grad *= LARGE_FACTOR
    ref = {"before": grads_of(ref_model)}
    ref["total"] = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), max_norm=max_norm, norm_type=norm_type)
    ref["after"] = grads_of(ref_model)
    ref_optim.step()
    ref["params"] = detached_copies(dict(ref_model.named_parameters()))
    ref["totals"] = []
    for i, inp in enumerate(inputs[1:]):
        ref_optim.zero_grad(set_to_none=i % 2 == 0)
        ref_model(*inp).sum().backward()
        average_gradients_([p.grad for p in ref_model.parameters()], ctx.group)
        ref["totals"].append(torch.nn.utils.clip_grad_norm_(ref_model.parameters(), max_norm=max_norm,
                                                            norm_type=norm_type))
        ref_optim.step()
    return ref


def _inputs(ctx, model) -> list:
    """The four iterations' inputs (seeds 1 to 4), the same on both sides."""
    inputs = []
    for seed in range(1, 5):
        with ctx.seeded(seed):
            inputs.append(model.get_input(ctx.device))
    return inputs


@distributed(world_size=[2, 4])
@pytest.mark.requires.with_args(_ddp_parity_requires)
@pytest.mark.parametrize("offload", [False, True], ids=["no_offload", "offload"])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD", "mixed_strategy"])
@pytest.mark.parametrize("norm_type", [1.0, 2.0, INF])
@pytest.mark.parametrize("max_norm", [1, 2.5])
def test_ddp_parity(ctx, impl, max_norm, norm_type, strategy, offload):
    """Clip on the sharded model == torch.nn.utils.clip_grad_norm_ on the data-parallel one."""
    ref = shared_reference.computed_once(ctx, _data_parallel_clip, max_norm, norm_type)
    with ctx.seeded(0):
        model = M.TransformerWithSharedParams(ctx.rank, ctx.world_size, deterministic=True, device=ctx.device)
    inputs, get_loss = _inputs(ctx, model), model.get_loss
    common = dict(offload=offload, mesh=ctx.mesh())
    if strategy == "mixed_strategy":
        spec = shard_spec_of(model, "mixed_strategy", **common)
    else:
        spec = shard_spec_of(model, strategy=strategy, **common)
    model = impl.shard(model, spec)
    optim = torch.optim.Adam(model.parameters(), lr=LR)

    get_loss(inputs[0], model(*inputs[0])).backward()
    # Scale gradients by a large factor so that they are certainly clipped.
    for p in model.parameters():
        if p.grad is not None:  # None is possible (FSDP1 use_orig_params=True)
            p.grad *= LARGE_FACTOR
    local_before = [None if p.grad is None else local_part(p.grad).clone() for p in model.parameters()]
    full_before = detached_copies(impl.full_grads(model))
    assert_close(ctx, full_before, ref["before"], "scaled grads before clip")

    total = impl.clip_grad_norm_(model, max_norm, norm_type)
    assert ref["total"].item() > max_norm, "reference total norm below max_norm: clipping would be vacuous"
    assert_close(ctx, total, ref["total"], "total norm")
    # Every gradient was modified by clipping (the seed's check), on both sides.
    for name, g in ref["after"].items():
        assert not torch.equal(g, ref["before"][name]), f"reference {name} not clipped"
    for p, before in zip(model.parameters(), local_before):
        if p.grad is None:
            assert before is None, "a gradient appeared during clip_grad_norm_"
        elif before.numel():
            assert not torch.equal(local_part(p.grad), before), "a local gradient was not clipped"
    full_after = detached_copies(impl.full_grads(model))
    assert_close(ctx, full_after, ref["after"], "grads after clip")
    assert_clipped(full_before, full_after, max_norm, norm_type, "full")

    optim.step()
    assert_close(ctx, detached_copies(impl.full_params(model)), ref["params"], "params after step")

    # A few more iterations. The seed skips them with offload because GPU and CPU arithmetic drift
    # apart (pytorch#89133); here compute and offload are both on the CPU, so they run in every cell.
    for i, inp in enumerate(inputs[1:]):
        optim.zero_grad(set_to_none=i % 2 == 0)  # exercise both
        model(*inp).sum().backward()
        total = impl.clip_grad_norm_(model, max_norm, norm_type)
        assert_close(ctx, total, ref["totals"][i], f"it{i + 1} total norm")
        optim.step()
    # Like the seed, no parameter comparison after these steps: the key part of each attention
    # in_proj_bias has an analytically zero gradient (softmax is shift-invariant), so its float noise
    # differs with the reduction order and Adam turns noise into lr-sized steps (pytorch#89136).


def _low_precision_requires(params):
    needed = {"nested_units", "mixed_precision", "keep_low_precision_grads",
              of_strategy(params["strategy"])}
    return needed


@distributed(world_size=[2, 4])
@pytest.mark.requires.with_args(_low_precision_requires)
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
@pytest.mark.parametrize("norm_type", [1.0, 2.0, INF])
@pytest.mark.parametrize("max_norm", [1, 2.5])
def test_low_precision_grads(ctx, impl, max_norm, norm_type, strategy):
    """fp16 gradients kept in fp16: the total norm is fp16 and every gradient is clipped."""
    with ctx.seeded(0):
        model = M.NestedWrappedModule(ctx.rank, ctx.world_size, deterministic=True, device=ctx.device)
        inp = model.get_input(ctx.device)  # seeds 1 + rank: different inputs per rank
    mp = MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float16, keep_low_precision_grads=True)
    model = impl.shard(model, shard_spec_of(model, strategy=strategy, mixed_precision=mp, mesh=ctx.mesh()))
    model(*inp).sum().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads, "no gradients after backward"
    for g in grads:
        assert g.dtype == torch.float16, f"gradient dtype {g.dtype}, expected torch.float16"
    full_before = detached_copies(impl.full_grads(model))
    # The expected total norm from the full fp16 gradients (in fp32, as a sharded sum would be).
    norms = torch.stack([torch.linalg.vector_norm(g.float(), norm_type) for g in full_before.values()
                         if g is not None])
    expected = norms.max() if norm_type == INF else torch.linalg.vector_norm(norms, norm_type)
    assert expected.item() > max_norm, "total norm below max_norm: clipping would be vacuous"

    total = impl.clip_grad_norm_(model, max_norm, norm_type)
    assert total.dtype == torch.float16, f"total norm dtype {total.dtype}, expected torch.float16"
    assert_close(ctx, total, expected.to(torch.float16), "total norm", dtype=torch.float16)
    # As the seed: each (local) gradient has norm at most max_norm; DDP has no fp16-grad mode to
    # compare with. The full gradients must be clipped too.
    for p in model.parameters():
        if p.grad is not None:
            norm = norm_of(local_part(p.grad), norm_type)
            assert norm <= max_norm, f"local gradient norm {norm} > max_norm {max_norm}"
    assert_clipped(full_before, detached_copies(impl.full_grads(model)), max_norm, norm_type, "full")


@distributed(world_size=[2, 4])
@pytest.mark.requires("shard_grad_op", "mixed_precision")
def test_no_gradients(ctx, impl):
    """Clip with no gradients: warns, and returns a float32 zero."""
    with ctx.seeded(0):
        model = nn.Linear(24, 24, device=ctx.device)
        inp = torch.randn(32, 24, device=ctx.device)
    mp = MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32, buffer_dtype=torch.float32)
    model = impl.shard(model, ShardSpec(strategy="SHARD_GRAD_OP", mixed_precision=mp, mesh=ctx.mesh()))
    model(inp)
    pattern = (f"on rank {ctx.rank} with no gradients -- returning the total norm in the default "
               "dtype torch.float32")
    with record_warnings() as log:
        total = impl.clip_grad_norm_(model, 1, 2.0)
        mine = [w for w in log if issubclass(w.category, UserWarning) and pattern in str(w.message)]
    assert mine, f"no UserWarning matching {pattern!r}"
    assert total.dtype == torch.float32, f"total norm dtype {total.dtype}, expected torch.float32"
    assert_close(ctx, total, torch.tensor(0.0), "total norm")
