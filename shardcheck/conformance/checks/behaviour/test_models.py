"""Real models (family models): the architectures users shard, as transformers builds them
(checks/support/zoo.py: Llama with grouped-query attention, tied and untied; GPT-2's Conv1D; a
Mixtral mixture of experts with its router's auxiliary loss), each wrapped per decoder layer as the
recipes wrap it, train exactly as unsharded data-parallel training does: three steps of AdamW with
the gradients clipped by their 2-norm, the loss, the full averaged gradients, the total norm and the
parameters compared after every step (checks/support/parity.py), for each sharding strategy.

`shardcheck run --model pkg.module:factory` judges the user's own model in the same cells, instead
of the zoo (checks/support/own_model.py).
"""

from __future__ import annotations

import pytest

import torch

from shardcheck.conformance.checks.support import own_model, zoo
from shardcheck.conformance.checks.support.parity import train_in_parity
from shardcheck.conformance.protocol import Clip, MixedPrecision, Optimizer, Recipe, ShardSpec
from shardcheck.conformance.protocol import documented
from shardcheck.conformance.protocol.capabilities import of_norm, of_strategy
from shardcheck.harness import distributed

STEPS = 3
CLIP = Clip(1.0, 2.0)  # below the first steps' total norms of every architecture: clipping is active
OPTIMIZER = Optimizer("adamw", lr=1e-3)
STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "SHARD_OPTIMIZER"]


def _needs(params) -> set[str]:
    return {of_strategy(params["strategy"]), of_norm(CLIP.norm_type)}


def pytest_generate_tests(metafunc):
    if "model_name" in metafunc.fixturenames:
        own = own_model.names(metafunc.config)  # given, the family judges them alone
        missing = pytest.mark.skipif(not zoo.available(), reason=zoo.MISSING)  # this machine's, not the engine's
        metafunc.parametrize("model_name", own or [pytest.param(name, marks=[missing, *zoo.PRELOAD])
                                                    for name in sorted(zoo.ARCHS)])


@distributed(world_size=[2, 4])
@pytest.mark.requires.with_args(_needs)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_model_parity(ctx, impl, strategy, model_name):
    """Three steps of AdamW, clipped by norm 2, per decoder-layer units: loss, gradients, norm and
    parameters match unsharded data-parallel training after every step."""
    own = own_model.is_own(model_name)
    workload = own_model.workload(model_name) if own else zoo.WORKLOADS[model_name]
    recipe = Recipe(loss_fn=workload.loss_fn, optimizer=OPTIMIZER, clip=CLIP)
    spec = ShardSpec(strategy=strategy, units=workload.units, mesh=ctx.mesh())
    results = train_in_parity(ctx, impl, workload.build, spec, recipe, workload.batches(ctx, STEPS))
    ctx.record("clipped", results[0].total_norm > CLIP.max_norm)
    if not own:  # not vacuous: clipping changed the first step (a user's model may have smaller gradients)
        assert results[0].total_norm > CLIP.max_norm, f"total norm {results[0].total_norm} <= max_norm: nothing clipped"



@distributed(world_size=2)
@pytest.mark.skipif(not zoo.available(), reason=zoo.MISSING)
@zoo.preloaded
@pytest.mark.requires.with_args(lambda params: _needs(params) | {"mixed_precision_bf16"})
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_bf16_loaded_model(ctx, impl, strategy):
    """Llama saved with `save_pretrained` and loaded with `from_pretrained(dtype=torch.bfloat16)`, as
    fine-tuning recipes load it, trained two steps of AdamW under a bf16 mixed-precision policy: the
    optimizer steps the master weights the engine's documentation promises (protocol/documented.py:
    the weights as loaded, bfloat16, as torch's optimizers step the parameters they are given; or
    float32 ones). The dtype is told by the values, as every engine's full parameters arrive as
    float32: bfloat16 master weights hold bfloat16 values only, float32 ones do not once moved."""
    promise = documented.of(impl)
    master = torch.float32 if promise.low_precision_load == documented.FLOAT32 else torch.bfloat16
    arch = zoo.ARCHS["llama"]
    workload = arch.workload()
    spec = ShardSpec(strategy=strategy, units=workload.units, mesh=ctx.mesh(),
                     mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    with ctx.seeded(0):
        model = arch.loaded_in(torch.bfloat16).to(ctx.device)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}, "from_pretrained(dtype=bfloat16) loaded another dtype"
    trainer = impl.trainer(model, spec, Recipe(loss_fn=workload.loss_fn, optimizer=OPTIMIZER, clip=CLIP))
    try:
        loaded = trainer.full_params()
        for batch in workload.batches(ctx, 2):
            trainer.forward_backward(batch)
            trainer.step()
        params = trainer.full_params()
    finally:
        if hasattr(trainer, "close"):
            trainer.close()
    moved = [n for n, p in params.items() if not torch.equal(p, loaded[n])]
    assert moved, "no parameter moved in two steps: nothing to tell the master weights by"
    wide = [n for n in moved if not torch.equal(params[n], params[n].to(torch.bfloat16).float())]
    seen = torch.float32 if wide else torch.bfloat16
    where = promise.source or "torch's optimizers step the parameters they are given"
    ctx.record("master_weights", str(seen))
    assert seen == master, (f"master weights {seen} after two steps ({len(wide)} of {len(moved)} moved parameters hold "
                            f"values bfloat16 cannot): {impl.name} promises {promise.low_precision_load} ({where})")
