"""Loss scaling for sharded gradients: ``torch.amp.GradScaler`` whose inf/NaN check is global.

Each rank only sees its shards, so an overflow may be visible on one rank only.  After unscaling
(``grad *= 1/scale`` and ``found_inf = any(!isfinite(grad))`` per device), the per-device flags are
summed and all-reduced over the process group; every rank then sees the same ``found_inf``, skips
the same ``optimizer.step()`` and backs off the scale identically.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch.amp.grad_scaler import OptState


class ShardedGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` for sharded models.

    ``device=None`` means CUDA if available else CPU; the scale itself lives on the device of the
    first scaled output (the parameters' device), and the scaler is never disabled on CPU.
    ``process_group=None`` is the default group (no communication if none is initialised).
    """

    def __init__(
        self,
        device: Optional[str] = None,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        process_group=None,
    ) -> None:
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        super().__init__(device, init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval, enabled=enabled)
        self.process_group = process_group

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16: bool = True):
        """``grad *= inv_scale`` for every gradient (dense or sparse; float32, float16 or bfloat16),
        computed in float32 and rounded once to the gradient's dtype; returns ``{device: found_inf}``,
        1 on a device where a gradient held an inf or NaN, like torch. Written out: torch's
        ``_amp_foreach_non_finite_check_and_unscale_`` refuses bfloat16 on CUDA, the gradients
        ``keep_low_precision_grads`` leaves in bfloat16 included."""
        per_device: dict[torch.device, torch.Tensor] = {}
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is None:
                        continue
                    if not allow_fp16 and param.grad.dtype == torch.float16:
                        raise ValueError("Attempting to unscale FP16 gradients.")
                    if param.grad.is_sparse:  # coalesced first: duplicate float16 values may overflow when summed
                        if param.grad.dtype is torch.float16:
                            param.grad = param.grad.coalesce()
                        grad = param.grad._values()
                    else:
                        grad = param.grad
                    flag = per_device.setdefault(grad.device, found_inf.to(grad.device, copy=True))
                    torch.maximum(flag, (~torch.isfinite(grad)).any().float(), out=flag)
                    grad.copy_(grad.float() * inv_scale.to(grad.device))
        return per_device

    def unscale_(self, optimizer) -> None:
        if not self._enabled:
            return
        self._check_scale_growth_tracker("unscale_")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        inv_scale = self._scale.double().reciprocal().float()
        found_inf = torch.full((), 0.0, dtype=torch.float32, device=self._scale.device)
        per_device = self._unscale_grads_(optimizer, inv_scale, found_inf, True)
        if not per_device:  # a rank without gradients still takes part in the all-reduce
            per_device = {self._scale.device: found_inf}
        self._sync_found_inf(per_device)
        state["found_inf_per_device"] = per_device
        state["stage"] = OptState.UNSCALED

    def _sync_found_inf(self, per_device: dict) -> None:
        """``found_inf <- sum over ranks and devices of found_inf`` on every device, one all-reduce."""
        if self.process_group is None and not dist.is_initialized():
            return
        if self.process_group is not None and self.process_group.size() == 1:
            return
        total = sum(v.to(self._scale.device) for v in per_device.values())
        dist.all_reduce(total, group=self.process_group)
        for v in per_device.values():
            v.copy_(total)
