"""Step-by-step parity of a candidate's training with unsharded data-parallel training.

`train_in_parity` builds the same model twice (same seed), hands one to the candidate's trainer and
one to `DataParallelReference`, feeds both the same per-rank batches, and after every step compares
the loss, the full gradients (averaged, unscaled, before clipping), the step's report (total norm,
skipped, loss scale) and the full parameters. Every comparison's measured error is recorded. The
reference's run is shared by the cells that train alike (shared_reference.py): the strategies of one
workload, the implementations of one run.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Callable

import torch

from shardcheck.conformance.checks.support import shared_reference
from shardcheck.conformance.checks.support.compare import assert_close
from shardcheck.conformance.checks.support.dp_reference import DataParallelReference
from shardcheck.conformance.protocol import Recipe, ShardSpec


def train_in_parity(ctx, impl, build: Callable[[], torch.nn.Module], spec: ShardSpec, recipe: Recipe,
                    batches: list, *, dtype: torch.dtype | None = None, watch=None) -> list:
    """Run len(batches) steps on both sides; return the reference's StepResults. `batches[i]` is this
    rank's batch of step i (a list of `recipe.accumulation_steps` micro-batches when that is > 1).
    `dtype`: the tolerance's dtype (default: that of the expected values). `watch(ctx, modules,
    spec, recipe, trainer)`: observers of the candidate's run (dtype_contract.Watch), installed on the
    user's modules once the trainer is built, so that they see what the engine's hooks made;
    `modules` maps each path to (module, parameter names, {buffer name: dtype as built})."""
    with ctx.seeded(0):
        model = build().to(ctx.device)
    frozen = tuple(n for n, p in model.named_parameters() if not p.requires_grad)
    assert set(frozen) == set(recipe.frozen), f"the model's frozen parameters {frozen} != recipe.frozen {recipe.frozen}"
    key = shared_reference.key(ctx, build, model, spec, recipe, batches)
    reference = shared_reference.replay_or_record(
        ctx, key, lambda: DataParallelReference(copy.deepcopy(model), spec, recipe, ctx.group))
    modules = {path: (m, tuple(m._parameters), {n: b.dtype for n, b in m._buffers.items() if b is not None})
               for path, m in model.named_modules()}
    trainer = impl.trainer(model, spec, recipe)
    observer = None if watch is None else watch(ctx, modules, spec, recipe, trainer)
    try:
        results = compare_steps(ctx, trainer, reference, recipe, batches, dtype, watch=observer)
        reference.keep()
        return results
    finally:
        if observer is not None:
            observer.close()
        if hasattr(trainer, "close"):
            trainer.close()


class _NoWatch:
    def during(self, step: int, phase: str, micro: int = 0):
        return contextlib.nullcontext()

    def verify(self) -> None:
        pass


def compare_steps(ctx, trainer, reference, recipe, batches, dtype=None, *, first: int = 0, watch=None) -> list:
    """Train `trainer` and `reference` on `batches` side by side (the recipe's requires_grad
    schedule applied to both before each step), comparing the evaluation loss
    (when `recipe.eval_every` asks for one before the step), every micro-batch's loss (after
    `begin_step` on both sides, with the step's micro-batches, when the loss is token-weighted), the full
    gradients, the step's report and the full parameters after every step (numbered from `first` in
    messages); return the reference's StepResults. `watch` observes the trainer's phases and
    names the first broken boundary before the numbers are compared."""
    watch = watch or _NoWatch()
    results = []
    for i, batch in enumerate(batches, start=first):
        micro = recipe.micro_batches(batch)
        for names, flag in recipe.requires_grad_before(i):
            trainer.set_requires_grad(names, flag)
            reference.set_requires_grad(names, flag)
        if recipe.evaluates_before(i):
            with watch.during(i, "eval"):
                loss = trainer.evaluate(micro[0])
            assert_close(ctx, loss.float(), reference.evaluate(micro[0]).float(), f"step {i} eval loss", dtype=dtype)
        if recipe.tokens is not None:  # the step's token count, agreed before its first backward
            trainer.begin_step(micro)
            reference.begin_step(micro)
        for j, one in enumerate(micro):
            with watch.during(i, "forward_backward", j):
                loss = trainer.forward_backward(one)
            watch.verify()  # a broken boundary is named before the numbers it breaks
            ref_loss = reference.forward_backward(one)
            where = f"step {i} micro-batch {j}" if len(micro) > 1 else f"step {i}"
            assert_close(ctx, loss.float(), ref_loss.float(), f"{where} loss", dtype=dtype)
        got_grads, want_grads = trainer.full_grads(), reference.full_grads()
        if recipe.routed:  # an idle expert's None or zero: one gradient; the step tells them apart (Recipe.routed)
            got_grads, want_grads = _zeros_for_none(got_grads, want_grads, recipe.routed)
        assert_close(ctx, got_grads, want_grads, f"step {i} gradients", dtype=dtype)
        with watch.during(i, "step"):
            got = trainer.step()
        want = reference.step()
        watch.verify()
        if recipe.clip is not None:
            assert got.total_norm is not None, f"step {i}: the trainer clipped but reported no total norm"
            assert_close(ctx, torch.tensor(float(got.total_norm)), torch.tensor(want.total_norm),
                         f"step {i} total norm", dtype=dtype)
        if recipe.loss_scale is not None:
            assert got.skipped == want.skipped, (f"step {i}: skipped={got.skipped}, unsharded data-parallel "
                                                 f"training skipped={want.skipped}")
            assert got.scale == want.scale, f"step {i}: loss scale {got.scale}, expected {want.scale}"
        norm = None if got.total_norm is None else repr(round(float(got.total_norm), 6))  # nan == nan
        ctx.assert_equal_across_ranks((got.skipped, got.scale, norm), f"step {i} report")
        assert_close(ctx, trainer.full_params(), reference.full_params(), f"step {i} parameters", dtype=dtype)
        results.append(want)
    return results


def _zeros_for_none(got: dict, want: dict, names) -> tuple[dict, dict]:
    """`got` and `want` with a None gradient of a routed parameter (`names`) as zeros where the other side
    has a tensor: engines leave an expert no rank used None or zero, and only the optimizer's step, whose
    parameters are compared after it, shows the difference (AdamW skips None, decays and steps zero)."""
    got, want = dict(got), dict(want)
    for name in names:
        a, e = got.get(name), want.get(name)
        if a is None and e is not None:
            got[name] = torch.zeros_like(e)
        elif e is None and a is not None:
            want[name] = torch.zeros_like(a)
    return got, want
