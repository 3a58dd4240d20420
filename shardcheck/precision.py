"""The mixed-precision policy, defined once: what a check asks for (`ShardSpec.mixed_precision`, the
protocol's `MixedPrecision`) is what the reference implementation's units obey (`reference_impl.MixedPrecision`),
the same class.  It imports no torch, so the lowest layers may import it.

* ``param_dtype``: the shards are all-gathered and the forward/backward runs in this dtype (the
  sharded (master) parameters and the optimizer stay in their original dtype, float32).
* ``reduce_dtype``: gradients are averaged across ranks in this dtype (default: ``param_dtype``).
* ``buffer_dtype``: floating-point buffers are cast to it (FSDP1's).
* ``keep_low_precision_grads``: leave the averaged sharded gradient in ``reduce_dtype`` instead of
  casting it back to the parameter's dtype (FSDP1's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class MixedPrecision:
    """Compute in `param_dtype`, reduce gradients in `reduce_dtype`; the sharded (master) parameters
    and the optimizer stay in float32. `buffer_dtype` and `keep_low_precision_grads` are FSDP1's."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    keep_low_precision_grads: bool = False
