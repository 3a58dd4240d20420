"""Mutants: deliberately broken variants of reference_impl, to show the checks can fail.

Each mutant is an adapter (``--impl conformance.mutants:<Class>``): the reference adapter with one
bug patched into ``reference_impl`` in every process it reaches (see ``_base.py``). Patches are
process-global and never undone, so run each mutant in its own pytest process;
``tests/conformance/test_mutants.py`` does, over the check functions listed here, and asserts that
every mutant is killed (some cell FAILS) while the unmutated reference passes the same cells.

Catalogue (checks: the check functions expected to kill it, under conformance/checks/; a mutant with
``survivor`` set is a documented gap in the checks, run as a strict xfail):

=====================================  ==============================================================  =================================================================
mutant (class)                         bug class modelled                                              checks expected to kill it
=====================================  ==============================================================  =================================================================
mutant-clip-local-norm                 clip norm from the local shard only (no all-reduce)             test_clip_grad_dtensor.py::test_clip_grad_norm_1d
  (ClipLocalNorm)
mutant-clip-replicated-overcount       NO_SHARD/replicated grads counted once per rank in the norm     test_clip_grad.py::test_ddp_parity
  (ClipReplicatedOvercount)
mutant-clip-inf-summed                 inf-norm all-reduced with SUM instead of MAX                    test_clip_grad_dtensor.py::test_clip_grad_norm_1d
  (ClipInfSummed)
mutant-clip-unclamped                  clip coefficient not clamped to 1 (small grads scaled up)       test_clip_grad.py::test_below_max_norm_leaves_grads_unchanged
  (ClipUnclamped)
mutant-clip-non-root-accepted          clip_grad_norm_ on a non-root unit not rejected                 test_clip_grad.py::test_non_root
  (ClipNonRootAccepted)
mutant-scaler-found-inf-unsynced       found_inf not all-reduced across ranks                          test_grad_scaler.py::test_sharded_grad_scaler_found_inf
  (ScalerFoundInfUnsynced)
mutant-scaler-backoff-local            scale backed off only on the rank that saw inf                  test_grad_scaler.py::test_sharded_grad_scaler_found_inf
  (ScalerBackoffLocal)
mutant-scaler-unscale-skips-sparse     unscale_ skips sparse gradients                                 test_grad_scaler.py::test_scaling_unscaling_sparse
  (ScalerUnscaleSkipsSparse)
mutant-comm-hook-ignored               comm hook registered but the default collective used            test_comm_hooks.py::test_custom_hook_called
  (CommHookIgnored)
mutant-comm-hook-reregister            second comm hook registration not rejected                      test_comm_hooks.py::test_default_communication_hook_initialization
  (CommHookReregister)
mutant-comm-hook-non-root-accepted     comm hook registration on a non-root unit not rejected          test_comm_hooks.py::test_registering_hook_non_root
  (CommHookNonRootAccepted)
mutant-grad-divide-twice               divide factor: pre-divide plus full world-size post-divide      test_comm_hooks.py::test_default_communication_hook_behavior
  (GradDivideTwice)
mutant-grad-not-averaged               divide factor: gradients summed, not averaged                   test_comm_hooks.py::test_default_communication_hook_behavior
  (GradNotAveraged)
mutant-mp-reduce-in-param-dtype        mixed precision reduce in param dtype, reduce_dtype ignored     test_comm_hooks.py::test_low_precision_hook
  (ReduceInParamDtype)
mutant-mp-low-precision-grads-upcast   keep_low_precision_grads ignored (grads upcast)                 test_clip_grad.py::test_low_precision_grads
  (LowPrecisionGradsUpcast)
mutant-uneven-pad-front                uneven chunking: trailing rank's rows shifted by its padding    test_clip_grad.py::test_ddp_parity
  (UnevenPadFront)
mutant-full-shard-stale-regather       FULL_SHARD backward re-gather reuses stale (pre-step) params    test_clip_grad_dtensor.py::test_clip_grad_norm_1d
  (StaleRegather)
mutant-ext-hooks-ignored               all-gather extension hooks silently ignored                     test_extensions.py::test_monkey_patch, ::test_train_parity
  (ExtensionHooksIgnored)
mutant-ext-instance-hooks-ignored      hooks patched onto the shard object ignored (class lookup)      test_extensions.py::test_monkey_patch, ::test_train_parity
  (ExtensionInstanceHooksIgnored)
=====================================  ==============================================================  =================================================================
"""

from conformance.mutants._base import MutantAdapter, applied
from conformance.mutants.clip import (
    ClipInfSummed,
    ClipLocalNorm,
    ClipNonRootAccepted,
    ClipReplicatedOvercount,
    ClipUnclamped,
)
from conformance.mutants.comm import (
    CommHookIgnored,
    CommHookNonRootAccepted,
    CommHookReregister,
)
from conformance.mutants.extensions import (
    ExtensionHooksIgnored,
    ExtensionInstanceHooksIgnored,
)
from conformance.mutants.scaler import (
    ScalerBackoffLocal,
    ScalerFoundInfUnsynced,
    ScalerUnscaleSkipsSparse,
)
from conformance.mutants.sharding import (
    GradDivideTwice,
    GradNotAveraged,
    LowPrecisionGradsUpcast,
    ReduceInParamDtype,
    StaleRegather,
    UnevenPadFront,
)

MUTANTS: tuple[type[MutantAdapter], ...] = (
    ClipLocalNorm,
    ClipReplicatedOvercount,
    ClipInfSummed,
    ClipUnclamped,
    ClipNonRootAccepted,
    ScalerFoundInfUnsynced,
    ScalerBackoffLocal,
    ScalerUnscaleSkipsSparse,
    CommHookIgnored,
    CommHookReregister,
    CommHookNonRootAccepted,
    GradDivideTwice,
    GradNotAveraged,
    ReduceInParamDtype,
    LowPrecisionGradsUpcast,
    UnevenPadFront,
    StaleRegather,
    ExtensionHooksIgnored,
    ExtensionInstanceHooksIgnored,
)

__all__ = ["MUTANTS", "MutantAdapter", "applied"] + [m.__name__ for m in MUTANTS]
