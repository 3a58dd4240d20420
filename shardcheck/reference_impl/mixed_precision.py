"""Mixed precision: which dtype each tensor has at each step.

* ``param_dtype``: the shards are all-gathered and the forward/backward runs in this dtype (the
  sharded parameters and the optimizer stay in their original dtype).
* ``reduce_dtype``: gradients are averaged across ranks in this dtype (default: ``param_dtype``).
* ``buffer_dtype``: floating-point buffers are cast to it once, when the unit is created.
* ``keep_low_precision_grads``: leave the averaged sharded gradient in ``reduce_dtype`` instead of
  casting it back to the parameter's dtype.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch.utils._pytree import tree_map

from shardcheck.precision import MixedPrecision as MixedPrecision  # the protocol's ShardSpec.mixed_precision too


def compute_dtype(mp: Optional[MixedPrecision], orig: torch.dtype) -> torch.dtype:
    """Dtype of the unsharded parameter used in forward/backward."""
    if mp is None or mp.param_dtype is None or not orig.is_floating_point:
        return orig
    return mp.param_dtype


def reduce_dtype(mp: Optional[MixedPrecision], orig: torch.dtype) -> torch.dtype:
    """Dtype in which gradients travel: ``reduce_dtype``, else ``param_dtype``, else the original."""
    if mp is not None and mp.reduce_dtype is not None and orig.is_floating_point:
        return mp.reduce_dtype
    return compute_dtype(mp, orig)


def grad_dtype(mp: Optional[MixedPrecision], orig: torch.dtype) -> torch.dtype:
    """Dtype of the sharded gradient the optimizer sees."""
    if mp is not None and mp.keep_low_precision_grads:
        return reduce_dtype(mp, orig)
    return orig


def cast_floating(tree: Any, dtype: Optional[torch.dtype]) -> Any:
    """Cast every floating-point tensor in a nested structure of forward inputs to ``dtype``."""
    if dtype is None:
        return tree
    return tree_map(lambda x: x.to(dtype) if torch.is_tensor(x) and x.is_floating_point() else x, tree)


def cast_buffers(module: torch.nn.Module, mp: Optional[MixedPrecision]) -> None:
    """Cast the module's own floating-point buffers to ``buffer_dtype`` (in place of the old ones)."""
    if mp is None or mp.buffer_dtype is None:
        return
    for name, buf in module.named_buffers(recurse=False):
        if buf is not None and buf.is_floating_point():
            module._buffers[name] = buf.to(mp.buffer_dtype)
