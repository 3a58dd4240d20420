"""Mutants of the loop users run (family training_loop): gradient accumulation, no_sync, the input
cast and reduce dtype of mixed precision around an evaluation forward, the norm of low-precision
gradients (shardcheck/reference_impl/sharding.py, accumulation.py, clip.py).

Besides the check functions that must each kill it, each names `cells`: globs over the cells of
those functions at world size 2 that must fail, every other cell of them must pass
(tests/conformance/test_mutants.py::test_loop_mutant_kills_exactly).
"""

from __future__ import annotations

import dataclasses
import importlib

import torch
from torch.utils._pytree import tree_map

from shardcheck.conformance.mutants.base import MutantAdapter, replace

LOOP = "test_training_loop.py::test_training_loop"
MIXED = "test_training_loop.py::test_training_loop_mixed_precision"
LOW_GRADS = "test_training_loop.py::test_low_precision_grads_norm"
SCHEDULES = "test_training_loop.py::test_requires_grad_changes"
OFFLOAD = "test_composition.py::test_cpu_offload"  # offloaded gradients accumulate the same way


def _module(name: str):
    return importlib.import_module(f"shardcheck.reference_impl.{name}")


def _reduce_dtype_lost_at_first_forward(lost) -> None:
    """Patch the reference so that a unit whose FIRST forward finds `lost(unit)` true drops its
    policy's reduce dtype for good (gradients reduced in param_dtype): state an engine resolves
    lazily, at the first forward, from what that forward happens to see."""
    sharding = _module("sharding")
    original = sharding.before_forward

    def resolving(module, args, kwargs):
        unit = sharding.unit_of(module)
        if not unit.__dict__.get("_dtypes_resolved"):
            unit._dtypes_resolved = True
            if unit.mp is not None and lost(unit):
                unit.mp = dataclasses.replace(unit.mp, reduce_dtype=None)
        return original(module, args, kwargs)

    replace(sharding, "before_forward", resolving)


class AccumulationOverwrite(MutantAdapter):
    """A micro-batch's reduced gradient REPLACES the shard's gradient instead of adding to it: with
    gradients synced on every micro-batch, the step trains on the last micro-batch's gradient only
    (no_sync runs reduce once per step, so they are untouched), CPU-offloaded gradients included."""

    name = "mutant-accumulation-overwrite"
    bug = "accumulated gradient overwritten by each micro-batch's (grad = g, not grad += g)"
    checks = (LOOP, MIXED, OFFLOAD)
    cells = ("test_training_loop[*-accumulate-*]", "test_training_loop_mixed_precision[*-accumulate-*]",
             "test_cpu_offload[*-every]")

    def patch(self) -> None:
        def overwrite(param, grad, dtype):
            param.grad = grad.to(device=param.device, dtype=dtype)

        replace(_module("sharding"), "_accumulate", overwrite)


class DetachedInputCast(MutantAdapter):
    """Mixed precision: a unit's floating inputs cast to the compute dtype outside autograd
    (``x.detach().to(dtype)``): every gradient behind a unit boundary is lost (embed gets only the
    residual path's share through `body`'s input)."""

    name = "mutant-mp-detached-input-cast"
    bug = "unit inputs cast to the compute dtype outside autograd (their gradient lost)"
    checks = (MIXED, LOW_GRADS)
    cells = ("test_low_precision_grads_norm[*]", *(f"test_training_loop_mixed_precision[*-{shape}-*]" for shape in
                                                   ("accumulate", "accumulate_no_sync", "eval_between", "tied", "unused")))

    def patch(self) -> None:
        def detached(tree, dtype):
            if dtype is None:
                return tree
            return tree_map(lambda x: x.detach().to(dtype) if torch.is_tensor(x) and x.is_floating_point() else x,
                            tree)

        replace(_module("sharding"), "cast_floating", detached)


class ReduceDtypeLostAfterEval(MutantAdapter):
    """A unit whose FIRST forward runs without gradients (an evaluation before training) loses the
    policy's reduce dtype: its gradients are reduced in param_dtype from then on (state set up
    lazily on a path the no-grad forward skips)."""

    name = "mutant-mp-reduce-lost-after-eval"
    bug = "reduce dtype lost after a no-grad first forward (gradients reduced in param dtype)"
    checks = (MIXED,)
    cells = ("test_training_loop_mixed_precision[*-eval_between-*]",)

    def patch(self) -> None:
        _reduce_dtype_lost_at_first_forward(lambda unit: not torch.is_grad_enabled())


class ReduceDtypeFromTrainable(MutantAdapter):
    """pytorch#186998 (FSDP2's `_init_mp_dtypes`): a unit resolves its reduce dtype at its first
    forward from the parameters that require gradients then; with none (a unit frozen for the first
    steps of fine-tuning) it keeps no reduce dtype, and once unfrozen its gradients are reduced in
    param_dtype. A unit trained first and frozen later is unaffected."""

    name = "mutant-mp-reduce-from-trainable"
    bug = "reduce dtype resolved at the first forward from trainable parameters (pytorch#186998)"
    checks = (SCHEDULES,)
    cells = ("test_requires_grad_changes[*-unfreeze*-bf16]", "test_requires_grad_changes[*-unfreeze*-fp16]")

    def patch(self) -> None:
        _reduce_dtype_lost_at_first_forward(lambda unit: not any(p.shard.requires_grad for p in unit.params))


class NormInGradDtype(MutantAdapter):
    """clip_grad_norm_ accumulates sum |g|^p (and reduces it across ranks) in the gradients' own
    dtype instead of float32: with low-precision gradients the norm is rounded to bfloat16."""

    name = "mutant-clip-norm-in-grad-dtype"
    bug = "clip norm accumulated and reduced in the gradient dtype (bfloat16), not float32"
    checks = (LOW_GRADS,)
    cells = ("test_low_precision_grads_norm[*]",)

    def patch(self) -> None:
        def in_grad_dtype(grads, norm_type, device):
            grads = [g for g in grads if g.numel() > 0]
            if not grads:
                return torch.zeros((), dtype=torch.float32, device=device)
            norms = torch.stack([torch.linalg.vector_norm(g, norm_type) for g in grads])
            return norms.max() if norm_type == float("inf") else (norms ** norm_type).sum()

        replace(_module("clip"), "_local_norm", in_grad_dtype)


class UnsyncedDroppedOnLast(MutantAdapter):
    """no_sync: the gradients held over the unsynced micro-batches are dropped when the last
    micro-batch reduces (only its own gradient is reduced)."""

    name = "mutant-no-sync-held-dropped"
    bug = "gradients held under no_sync dropped on the last micro-batch's reduction"
    checks = (LOOP, MIXED)
    cells = ("test_training_loop[*-accumulate_no_sync-*]", "test_training_loop_mixed_precision[*-accumulate_no_sync-*]")

    def patch(self) -> None:
        def dropped(unit, grads):
            unit.unsynced = None
            return list(grads)

        replace(_module("sharding"), "merge_unsynced", dropped)


class UnsyncedHeldInParamDtype(MutantAdapter):
    """F40's bug: gradients held across no_sync micro-batches are summed in the compute dtype
    (param_dtype), not in the reduce dtype; only the synced backward casts the rounded sum."""

    name = "mutant-no-sync-held-in-param-dtype"
    bug = "gradients held across no_sync micro-batches summed in param_dtype (F40)"
    checks = (MIXED,)
    cells = ("test_training_loop_mixed_precision[*-accumulate_no_sync-*]",)

    def patch(self) -> None:
        mixed = _module("mixed_precision")

        def hold(unit, grads):
            cast = [None if g is None else g.to(mixed.compute_dtype(unit.mp, g.dtype)) for g in grads]
            held = unit.unsynced or [None] * len(cast)
            unit.unsynced = [h if g is None else g if h is None else h + g for h, g in zip(held, cast)]

        replace(_module("sharding"), "hold", hold)
