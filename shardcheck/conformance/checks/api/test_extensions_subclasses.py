"""All-gather extensions of real tensor subclasses (family extensions; test_extensions.py has the
seed's TwoTensor cells): torchao's NF4Tensor (QLoRA: frozen quantized base + trainable adapters) and
its float8 training weight (`enable_fsdp_float8_all_gather`), under any implementation that declares
`all_gather_extensions` (checks/support/extension_subclasses.py builds them).

Per cell, three steps of Adam on a model whose weights are the subclass, sharded with its units, next
to the same model unsharded with its gradients averaged over the ranks by hand:

* the subclass's own hooks run (pre and post, counted on the local shards' instances), and what they
  put on the wire is the subclass's compact form (NF4: int8 / float32 / uint8; float8: e4m3fn only);
* the loss, every gradient (None for a frozen base on both sides), and every parameter (the NF4 base
  dequantized, unchanged) match the unsharded model's at the float32 tolerance: the all-gathered
  value is bitwise the unsharded subclass's value (the float8 scale is the global amax's).

Without the library a kit's cells are skipped with the reason and the install command: never a pass.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from shardcheck.conformance.checks.support.compare import assert_close
from shardcheck.conformance.checks.support.dp_reference import average_gradients_
from shardcheck.conformance.checks.support.extension_subclasses import KITS, missing, plain, spy_on_hooks
from shardcheck.conformance.protocol import ShardSpec
from shardcheck.harness import distributed

pytestmark = pytest.mark.requires("all_gather_extensions")
STEPS = 3


def _kits():
    return [pytest.param(name, marks=pytest.mark.skipif(bool(missing(name)), reason=missing(name) or ""))
            for name in sorted(KITS)]


def _values(named, grads: bool) -> dict:
    """{name: plain float32 value} of parameters (or their gradients), subclasses unwrapped."""
    return {n: plain(p.grad if grads else p) for n, p in named}


def _step(ctx, ref: nn.Module, model: nn.Module, optimizers, x: torch.Tensor, it: int, impl) -> None:
    losses = [m(x).pow(2).mean() for m in (ref, model)]
    for loss in losses:
        loss.backward()
    average_gradients_([p.grad for p in ref.parameters()], ctx.group)
    assert_close(ctx, losses[1], losses[0], f"step {it} loss")
    assert_close(ctx, {n: plain(g) for n, g in impl.full_grads(model).items()},
                 _values(ref.named_parameters(), grads=True), f"step {it} gradients")
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert_close(ctx, {n: plain(p) for n, p in impl.full_params(model).items()},
                 _values(ref.named_parameters(), grads=False), f"step {it} parameters")


@distributed(world_size=[2, 4])
@pytest.mark.parametrize("kit", _kits())
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_subclass_train_parity(ctx, impl, strategy, kit):
    """The subclass's hooks run, its compact dtypes go on the wire, and training matches unsharded."""
    spec = KITS[kit]
    models = []
    for _ in range(2):  # built twice from one seed: a deep copy of an NF4Tensor re-quantizes it
        with ctx.seeded(0):
            models.append(spec.build().to(ctx.device))
    ref, model = models
    model = impl.shard(model, ShardSpec(strategy=strategy, units=spec.units, mesh=ctx.mesh()))
    seen = {"pre": 0, "post": 0, "wire": set()}
    assert spy_on_hooks(impl.local_shards(model), seen) > 0, f"no local shard of {kit} has all-gather hooks"
    optimizers = [torch.optim.Adam([p for p in m.parameters() if p.requires_grad], lr=1e-2, foreach=False)
                  for m in (ref, model)]
    for it in range(STEPS):
        with ctx.seeded(1000 * it + ctx.rank):
            x = torch.randn(16, spec.inputs, device=ctx.device)
        _step(ctx, ref, model, optimizers, x, it, impl)
    assert seen["pre"] > 0 and seen["post"] > 0, f"the {kit} all-gather hooks never ran: {seen}"
    assert seen["wire"] == set(spec.wire), f"{kit} all-gathered {sorted(seen['wire'])}, expected {sorted(spec.wire)}"
    ctx.record("hook_calls", {"pre": seen["pre"], "post": seen["post"], "wire": sorted(seen["wire"])})
