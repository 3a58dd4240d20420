"""Mutants of the sharded grad scaler (shardcheck/reference_impl/grad_scaler.py)."""

from __future__ import annotations

import torch

from shardcheck.conformance.mutants.base import MutantAdapter, replace


def _hide_grads(optimizer, which) -> list:
    """Take off their parameters (``p.grad = None``) the gradients that ``which(param, grad)``
    picks, so that the original ``_unscale_grads_`` does not see them; returns the (param, grad)
    pairs to put back."""
    hidden = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None and which(p, p.grad):
                hidden.append((p, p.grad))
                p.grad = None
    return hidden


class ScalerFoundInfUnsynced(MutantAdapter):
    """``found_inf`` not synchronised across ranks: a plain ``torch.amp.GradScaler`` on shards. An
    overflow seen by one rank only makes that rank skip its step and back off; the others step on
    (their shards of) a poisoned update and keep their scale, so ranks diverge."""

    name = "mutant-scaler-found-inf-unsynced"
    bug = "found_inf not all-reduced across ranks"
    checks = ("test_grad_scaler.py::test_sharded_grad_scaler_found_inf", "test_loss_scaling.py::test_skip_backoff_growth")

    def patch(self) -> None:
        from shardcheck.reference_impl.grad_scaler import ShardedGradScaler

        replace(ShardedGradScaler, "_sync_found_inf", lambda self, per_device: None)


def _local_found_inf(optimizer) -> bool:
    for group in optimizer.param_groups:
        for p in group["params"]:
            g = p.grad
            if g is None:
                continue
            values = g.coalesce().values() if g.is_sparse else g
            if values.numel() and not torch.isfinite(values.float()).all():
                return True
    return False


class ScalerBackoffLocal(MutantAdapter):
    """The step decision uses the agreed ``found_inf``, but ``update()`` backs the scale off from
    this rank's own flags: only the rank that saw the inf halves its scale, and the ranks' scales
    (hence their next losses and gradients) diverge."""

    name = "mutant-scaler-backoff-local"
    bug = "scale backed off only on the rank that saw inf"
    checks = ("test_grad_scaler.py::test_sharded_grad_scaler_found_inf",)

    def patch(self) -> None:
        from shardcheck.reference_impl.grad_scaler import ShardedGradScaler

        unscale = ShardedGradScaler.unscale_
        update = ShardedGradScaler.update

        def unscale_(self, optimizer):
            unscale(self, optimizer)
            local = getattr(self, "_mutant_local_found_inf", {})
            local[id(optimizer)] = _local_found_inf(optimizer)  # after unscale: this rank's grads only
            self._mutant_local_found_inf = local

        def update_(self, new_scale=None):
            local = getattr(self, "_mutant_local_found_inf", {})
            if self._enabled and new_scale is None:
                for key, state in self._per_optimizer_states.items():
                    if key in local:
                        for flag in state["found_inf_per_device"].values():
                            flag.fill_(float(local[key]))
            self._mutant_local_found_inf = {}
            return update(self, new_scale)

        replace(ShardedGradScaler, "unscale_", unscale_)
        replace(ShardedGradScaler, "update", update_)


class ScalerUnscaleSkipsSparse(MutantAdapter):
    """``unscale_`` skips sparse gradients (a dense-only fast path): they stay multiplied by the
    scale and their infs are never seen, so an overflow in an embedding's sparse gradient is stepped."""

    name = "mutant-scaler-unscale-skips-sparse"
    bug = "unscale_ skips sparse gradients"
    checks = ("test_grad_scaler.py::test_scaling_unscaling_sparse",)

    def patch(self) -> None:
        from shardcheck.reference_impl.grad_scaler import ShardedGradScaler

        original = ShardedGradScaler._unscale_grads_

        def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16=True):
            hidden = _hide_grads(optimizer, lambda p, g: g.is_sparse)
            try:
                return original(self, optimizer, inv_scale, found_inf, allow_fp16)
            finally:
                for p, g in hidden:
                    p.grad = g

        replace(ShardedGradScaler, "_unscale_grads_", _unscale_grads_)


class ScalerSparseNoCoalesce(MutantAdapter):
    """fp16 sparse gradients unscaled and inf-checked value by value, WITHOUT coalescing: duplicate
    indices that only overflow once summed (2**15 + 2**15 in fp16) are never seen as inf. This is
    exactly what seed 001's third sparse sub-case meant to catch and, reading the previous
    sub-case's leftover inf, could not (a seed finding; the port tests it)."""

    name = "mutant-scaler-sparse-no-coalesce"
    bug = "fp16 sparse gradient inf-checked before coalescing (overflow on coalescing missed)"
    checks = ("test_grad_scaler.py::test_scaling_unscaling_sparse",)

    def patch(self) -> None:
        from shardcheck.reference_impl.grad_scaler import ShardedGradScaler

        original = ShardedGradScaler._unscale_grads_

        def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16=True):
            hidden = _hide_grads(optimizer, lambda p, g: g.is_sparse and g.dtype == torch.float16)
            for _, g in hidden:
                values = g._values()
                values.mul_(inv_scale.to(values.dtype))  # the bug: no coalesce() first
                if not torch.isfinite(values).all():
                    found_inf.fill_(1.0)
            try:
                per_device = original(self, optimizer, inv_scale, found_inf, allow_fp16)
                for p, _ in hidden:
                    per_device.setdefault(p.device, found_inf)
                return per_device
            finally:
                for p, g in hidden:
                    p.grad = g

        replace(ShardedGradScaler, "_unscale_grads_", _unscale_grads_)


class ScalerScaleNotNested(MutantAdapter):
    """``scale()`` of an iterable scales only its top-level tensors: tensors nested in inner tuples
    or lists come back unscaled (the recursion of torch's ``apply_scale`` dropped)."""

    name = "mutant-scaler-scale-not-nested"
    bug = "scale() does not recurse into nested iterables"
    checks = ("test_grad_scaler.py::test_grad_scaling",)

    def patch(self) -> None:
        from shardcheck.reference_impl.grad_scaler import ShardedGradScaler

        original = ShardedGradScaler.scale

        def scale(self, outputs):
            if isinstance(outputs, torch.Tensor):
                return original(self, outputs)
            return type(outputs)(original(self, o) if isinstance(o, torch.Tensor) else o for o in outputs)

        replace(ShardedGradScaler, "scale", scale)


class ScalerNoBackoff(MutantAdapter):
    """The step is skipped on inf/NaN, but the scale is not backed off (``update()`` ignores
    found_inf): every later step overflows again."""

    name = "mutant-scaler-no-backoff"
    bug = "scale not backed off after an inf/NaN step"
    checks = ("test_grad_scaler.py::test_inf_gradients_skip_optim_step",
              "test_loss_scaling.py::test_skip_backoff_growth")

    def patch(self) -> None:
        from shardcheck.reference_impl.grad_scaler import ShardedGradScaler

        update = ShardedGradScaler.update

        def update_(self, new_scale=None):
            if self._enabled and new_scale is None:
                for state in self._per_optimizer_states.values():
                    for flag in state["found_inf_per_device"].values():
                        flag.zero_()  # the bug: the backoff never sees the inf
            return update(self, new_scale)

        replace(ShardedGradScaler, "update", update_)


class ScalerGrowthOffByOne(MutantAdapter):
    """Growth interval off by one: the scale grows after ``growth_interval + 1`` finite steps."""

    name = "mutant-scaler-growth-off-by-one"
    bug = "growth interval off by one (grows one finite step late)"
    checks = ("test_loss_scaling.py::test_skip_backoff_growth",)

    def patch(self) -> None:
        from shardcheck.reference_impl.grad_scaler import ShardedGradScaler

        init = ShardedGradScaler.__init__

        def __init__(self, *args, **kwargs):
            init(self, *args, **kwargs)
            self._growth_interval += 1

        replace(ShardedGradScaler, "__init__", __init__)


class ScalerRefusesFp16Grads(MutantAdapter):
    """fairscale#834: the sharded scaler's `unscale_` keeps torch.amp.GradScaler's refusal of
    float16 gradients ("Attempting to unscale FP16 gradients"), so gradients kept in float16
    (keep_low_precision_grads) cannot be unscaled; bfloat16 and float32 gradients pass."""

    name = "mutant-scaler-refuses-fp16-grads"
    bug = "unscale_ refuses float16 gradients (fairscale#834)"
    checks = ("test_grad_scaler_low_grads.py::test_low_precision_grads_through_the_scaler",
              "test_grad_scaler.py::test_scaling_unscaling_sparse")  # the seed's sparse gradients are float16
    cells = ("test_low_precision_grads_through_the_scaler[*-fp16-*]", "test_scaling_unscaling_sparse[*]")

    def patch(self) -> None:
        from shardcheck.reference_impl.grad_scaler import ShardedGradScaler

        replace(ShardedGradScaler, "_unscale_grads_", lambda self, optimizer, inv_scale, found_inf, allow_fp16=True:
                torch.amp.GradScaler._unscale_grads_(self, optimizer, inv_scale, found_inf, False))


class ScalerInfCheckSkipsLowPrecision(MutantAdapter):
    """``unscale_`` unscales gradients kept in a lower precision than their parameter
    (keep_low_precision_grads) but leaves them out of the inf check: an overflow there is stepped,
    and the scale never backs off. Gradients in the parameter's dtype are checked as before."""

    name = "mutant-scaler-inf-skips-low-grads"
    bug = "inf check skips gradients kept below their parameter's precision"
    checks = ("test_grad_scaler_low_grads.py::test_low_precision_grads_through_the_scaler",)
    cells = ("test_low_precision_grads_through_the_scaler[*-inf_on_one_rank]",)

    def patch(self) -> None:
        from shardcheck.reference_impl.grad_scaler import ShardedGradScaler

        original = ShardedGradScaler._unscale_grads_

        def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16=True):
            low = _hide_grads(optimizer, lambda p, g: g.dtype != p.dtype)
            for _, g in low:
                g.mul_(inv_scale.to(g.device))  # unscaled, never inf-checked
            try:
                return original(self, optimizer, inv_scale, found_inf, allow_fp16)
            finally:
                for p, g in low:
                    p.grad = g

        replace(ShardedGradScaler, "_unscale_grads_", _unscale_grads_)
