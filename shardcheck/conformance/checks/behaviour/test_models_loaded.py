"""Real models saved and loaded (family models): the zoo's architectures (checks/support/zoo.py) loaded
as the front-ends load a pretrained model to save memory, checkpointed in the engine's own format, and
exported for transformers, each judged against the model loaded the plain way and trained unsharded.

* `test_meta_load`: the model saved as `save_pretrained` writes it, loaded by `from_pretrained` on rank 0
  alone while every other rank builds a skeleton on the meta device (capability `meta_load`:
  `Adapter.trainer_from_rank0`). The two traps of real models: rotary embeddings' `inv_freq`, a
  non-persistent buffer in no state dict (a loader that broadcasts the state dict alone leaves it as
  `to_empty` left it), and tied input and output embeddings (a tie lost on the skeletons).
* `test_resume`: the engine's own save, a fresh model (another seed) loads it, training goes on exactly
  as if it had never stopped (support/checkpoint.py), capability `checkpoint`.
* `test_export_from_pretrained`: the consolidated state dict (`Trainer.full_state_dict`) saved with
  `save_pretrained(state_dict=...)`, as users export a sharded model, loads with `from_pretrained` with
  no missing, unexpected or mismatched key, holds the unsharded run's values (tied weights one value)
  and computes its loss.
"""

from __future__ import annotations


import pytest
import torch

from shardcheck.conformance.checks.support import zoo
from shardcheck.conformance.checks.support.checkpoint import train_across_checkpoint, trained_and_exported
from shardcheck.conformance.checks.support.compare import assert_close
from shardcheck.conformance.checks.support.dp_reference import DataParallelReference
from shardcheck.conformance.checks.support.parity import compare_steps
from shardcheck.conformance.protocol import Clip, Optimizer, Recipe, ShardSpec
from shardcheck.conformance.protocol.capabilities import of_norm
from shardcheck.harness import distributed

STEPS = 3
CLIP = Clip(1.0, 2.0)  # as test_models.py: clipping active on every architecture's first step
OPTIMIZER = Optimizer("adamw", lr=1e-3)
NEEDS = {"full_shard", of_norm(CLIP.norm_type)}
ZOO = [pytest.param(name, marks=[pytest.mark.skipif(not zoo.available(), reason=zoo.MISSING), *zoo.PRELOAD])
       for name in sorted(zoo.ARCHS)]


def _recipe(workload) -> Recipe:
    return Recipe(loss_fn=workload.loss_fn, optimizer=OPTIMIZER, clip=CLIP)


def _close(trainer) -> None:
    if hasattr(trainer, "close"):
        trainer.close()


@distributed(world_size=[2, 4])
@pytest.mark.requires(*NEEDS, "meta_load")
@pytest.mark.parametrize("model_name", ZOO)
def test_meta_load(ctx, impl, model_name, tmp_path):
    """Saved, then loaded by rank 0 alone into a skeleton on meta on the other ranks: every rank's
    parameters are the saved ones (a tied weight one parameter), and three steps of AdamW clipped by
    norm 2 equal unsharded data-parallel training of the model every rank loaded the plain way (the
    first loss shows a rotary `inv_freq` left unfilled)."""
    arch, workload = zoo.ARCHS[model_name], zoo.WORKLOADS[model_name]
    recipe = _recipe(workload)
    folder = tmp_path / f"saved-{ctx.rank}"  # each rank writes its own: no rank waits on another's files
    with ctx.seeded(0):
        arch.save(arch.build(), folder)
    plain = arch.pretrained(folder).to(ctx.device).train()  # from_pretrained returns it in eval mode
    if ctx.rank == 0:
        model = arch.pretrained(folder).to(ctx.device).train()
    else:
        with torch.device("meta"):
            model = arch.build()
    spec = ShardSpec(units=workload.units, mesh=ctx.mesh())
    trainer = impl.trainer_from_rank0(model, spec, recipe)
    try:
        loaded = trainer.full_params()
        want = {n: p.detach() for n, p in plain.named_parameters()}
        assert sorted(loaded) == sorted(want), (
            f"parameters after loading {sorted(set(loaded) ^ set(want))} differ from the plain model's "
            f"(a weight transformers ties is one parameter)")
        wrong = [n for n in want if not torch.equal(loaded[n].to(want[n].device), want[n])]
        assert not wrong, f"parameters not the saved weights after loading: {wrong}"
        reference = DataParallelReference(plain, spec, recipe, ctx.group)
        compare_steps(ctx, trainer, reference, recipe, workload.batches(ctx, STEPS))
    finally:
        _close(trainer)


@distributed(world_size=[2, 4])
@pytest.mark.requires(*NEEDS, "checkpoint")
@pytest.mark.parametrize("model_name", ZOO)
def test_resume(ctx, impl, model_name, tmp_path):
    """2 steps, the engine's own save, a fresh model (another seed) and trainer load it, 2 more steps:
    parameters and AdamW's state right after the load, then every step, equal unsharded training that
    never stopped."""
    workload = zoo.WORKLOADS[model_name]
    recipe = _recipe(workload)
    spec_of = lambda mesh: ShardSpec(units=workload.units, mesh=mesh)  # noqa: E731
    train_across_checkpoint(ctx, impl, workload, recipe, tmp_path / "ckpt", save_size=ctx.world_size,
                            load_size=ctx.world_size, spec_of=spec_of)


@distributed(world_size=2)
@pytest.mark.requires(*NEEDS, "checkpoint")
@pytest.mark.parametrize("model_name", ZOO)
def test_export_from_pretrained(ctx, impl, model_name, tmp_path):
    """After 2 steps, `full_state_dict()` loads strictly into the plain model and, saved with
    `save_pretrained(state_dict=...)`, loads with `from_pretrained` with no missing, unexpected or
    mismatched key: the unsharded run's values (a tied weight one value) and its loss on a new batch."""
    arch, workload = zoo.ARCHS[model_name], zoo.WORKLOADS[model_name]
    recipe = _recipe(workload)
    batches = workload.batches(ctx, 3)
    exported, reference = trained_and_exported(ctx, impl, arch.build, ShardSpec(units=workload.units, mesh=ctx.mesh()),
                                               recipe, batches[:2])
    # Buffers (BatchNorm's running statistics) are each rank's own, under DDP's rule too (rank 0's before
    # each forward, then this rank's batch): judged on rank 0, whose export save_pretrained writes.
    buffers = {n for n, _ in reference.master.named_buffers()}
    want = {n: v for n, v in reference.master.state_dict().items() if ctx.rank == 0 or n not in buffers}
    plain = arch.build().to(ctx.device)
    plain.load_state_dict(exported, strict=True)
    assert_close(ctx, {n: v for n, v in plain.state_dict().items() if n in want}, want,
                 "the exported state dict, loaded into the plain model")
    folder = tmp_path / "export"  # one folder for the launch's ranks: save_pretrained writes on rank 0 alone
    arch.export(plain, folder, exported)
    ctx.barrier()
    loaded, info = arch.pretrained(folder, loading_info=True)
    keys = {k: sorted(v) for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    assert not keys, f"from_pretrained of the export: {keys}"
    loaded = loaded.to(ctx.device).train()  # as the plain run trains: BatchNorm on the batch's statistics
    assert_close(ctx, {n: v for n, v in loaded.state_dict().items() if n in want}, want,
                 "the exported model, loaded by from_pretrained")
    with torch.no_grad():
        assert_close(ctx, workload.loss_fn(loaded, batches[2]), workload.loss_fn(reference.master, batches[2]),
                     "the exported model's loss")
