"""Mutants of gradient reduction, mixed precision and the shard layout (shardcheck/reference_impl/sharding.py,
collectives.py)."""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F

from shardcheck.conformance.mutants.base import MutantAdapter, replace


def _collectives():
    return importlib.import_module("shardcheck.reference_impl.collectives")


def _sharding():
    return importlib.import_module("shardcheck.reference_impl.sharding")


class GradDivideTwice(MutantAdapter):
    """Gradient divided by the world size twice over: the pre-divide factor ``f`` is applied, and
    then the post-divide by the full ``W`` instead of ``W / f`` (pre/post divide bookkeeping bug), so
    gradients come out ``f`` times too small."""

    name = "mutant-grad-divide-twice"
    bug = "wrong gradient divide factor: pre-divide plus full world-size post-divide"
    checks = ("test_comm_hooks.py::test_default_communication_hook_behavior",)

    def patch(self) -> None:
        C = _collectives()
        replace(C, "divide_factors", lambda ws, factor=None: (C.predivide_factor(ws), float(ws)))


class GradNotAveraged(MutantAdapter):
    """Gradient summed, never divided: reduce-scatter / all-reduce SUM without the ``1/W`` (DDP
    semantics lost; effective learning rate times ``W``)."""

    name = "mutant-grad-not-averaged"
    bug = "wrong gradient divide factor: summed, not averaged"
    checks = ("test_comm_hooks.py::test_default_communication_hook_behavior",
              "test_grad_scaler.py::test_fsdp_ddp_parity_with_grad_scaler",
              "test_grad_scaler.py::test_fsdp_ddp_parity_with_grad_scaler_ws4",
              "test_train_parity.py::test_optimizer_parity")
    world_sizes = (2, 4)  # test_fsdp_ddp_parity_with_grad_scaler_ws4 runs at 4 only

    def patch(self) -> None:
        C = _collectives()
        replace(C, "divide_factors", lambda ws, factor=None: (1.0, 1.0))


class ReduceInParamDtype(MutantAdapter):
    """Mixed precision: gradients reduced in ``param_dtype`` instead of ``reduce_dtype`` (the
    reduce dtype ignored; with ``param_dtype=None`` they travel in full precision)."""

    name = "mutant-mp-reduce-in-param-dtype"
    bug = "mixed precision reduce done in param dtype, reduce_dtype ignored"
    checks = ("test_comm_hooks.py::test_low_precision_hook", "test_mixed_precision.py::test_low_precision_compute")

    def patch(self) -> None:
        from shardcheck.reference_impl.mixed_precision import compute_dtype

        replace(_sharding(), "reduce_dtype", lambda mp, orig: compute_dtype(mp, orig))


class LowPrecisionGradsUpcast(MutantAdapter):
    """``keep_low_precision_grads`` ignored: the averaged gradient is upcast to the parameter's
    dtype, so the optimizer (and clip) see fp32 gradients."""

    name = "mutant-mp-low-precision-grads-upcast"
    bug = "keep_low_precision_grads ignored (grads upcast)"
    checks = ("test_clip_grad.py::test_low_precision_grads",)

    def patch(self) -> None:
        replace(_sharding(), "grad_dtype", lambda mp, orig: orig)


class UnevenPadFront(MutantAdapter):
    """Padding bug in uneven chunking: a rank holding fewer than ``ceil(n / W)`` rows (the trailing
    rank) zero-pads BEFORE its rows instead of after, so after the all-gather its rows sit one pad
    too far and the last rows of the parameter are lost. Even splits are unaffected."""

    name = "mutant-uneven-pad-front"
    bug = "off-by-pad in uneven chunking: trailing rank's rows shifted by its padding"
    checks = ("test_clip_grad.py::test_ddp_parity",)

    def patch(self) -> None:
        C = _collectives()

        def pack_shards(shards, slots, dtype):
            parts = []
            for s, slot in zip(shards, slots):
                rows = s.to(dtype).reshape(-1, slot.row_numel)
                parts.append(F.pad(rows, (0, 0, slot.chunk - rows.shape[0], 0)).reshape(-1))  # front
            return torch.cat(parts) if parts else torch.empty(0, dtype=dtype)

        replace(C, "pack_shards", pack_shards)


class StaleRegather(MutantAdapter):
    """FULL_SHARD's backward re-gather uses stale parameters: the all-gather output of the first
    backward is cached and reused instead of re-gathering the (updated) shards, so from the second
    optimizer step on, gradients are computed with old weights (an unsharded buffer reused without
    being refilled)."""

    name = "mutant-full-shard-stale-regather"
    bug = "FULL_SHARD backward re-gather reuses stale (pre-step) parameters"
    checks = ("test_clip_grad_dtensor.py::test_clip_grad_norm_1d",)

    def patch(self) -> None:
        Unit = _sharding().Unit
        original = Unit.full_for_backward

        def full_for_backward(self):
            stale = self.__dict__.get("_mutant_stale")
            if self.full is None and stale is not None:
                self.full = stale  # the bug: no all-gather, last step's buffers
                return self.full
            full = original(self)
            self.__dict__.setdefault("_mutant_stale", full)
            return full

        replace(Unit, "full_for_backward", full_for_backward)


class HybridNoReplicaReduce(MutantAdapter):
    """HYBRID_SHARD: gradients reduced (and averaged) within the shard group only, never across the
    replicas: each replica group trains on its own data. Only visible with a replicate dimension > 1
    (world size 4 on a (2, 2) mesh); 1-D strategies are unaffected."""

    name = "mutant-hybrid-no-replica-reduce"
    bug = "HYBRID_SHARD gradients reduced within the shard group only, not across replicas"
    checks = ("test_train_parity.py::test_train_parity_hybrid",)
    world_sizes = (4,)  # HYBRID needs a replicate dimension > 1

    def patch(self) -> None:
        C = _collectives()
        original = C.average_gradient
        replace(C, "average_gradient",
                lambda flat, shard_group, replicate_group, factor=None: original(flat, shard_group, None, factor))


class HybridShardSizeSquared(MutantAdapter):
    """HYBRID_SHARD averages over ``sws * sws`` ranks (the shard group's size taken twice, a
    copy-paste slip for ``sws * rws``): exact on a square (replicate, shard) mesh, the only one the
    fixed matrix uses ((2, 2) at world size 4), wrong on every other: (1, 2) divides by 4 instead
    of 2, (2, 1) by 1 instead of 2. 1-D strategies are unaffected. Only drawn meshes find it:
    ``shardcheck explore`` (family explore)."""

    name = "mutant-hybrid-shard-size-squared"
    bug = "HYBRID_SHARD averages over sws * sws ranks: wrong on non-square meshes"
    checks = ("test_explore.py::test_explore",)

    def patch(self) -> None:
        C = _collectives()
        original = C.average_gradient

        def average_gradient(flat, shard_group, replicate_group, factor=None):
            if replicate_group is None or shard_group is None or factor is not None:  # 1-D strategies: untouched
                return original(flat, shard_group, replicate_group, factor)
            sws, rws = C.group_size(shard_group), C.group_size(replicate_group)
            return original(flat, shard_group, replicate_group) * (rws / sws)  # as if divided by sws * sws

        replace(C, "average_gradient", average_gradient)
