"""Gradient accumulation without communication: ``no_sync``.

Inside ``no_sync(root)`` a unit's backward does not reduce: each rank keeps its full (unsharded)
gradients, summed over the micro-batches, in the reduce dtype, on the unit (``unit.unsynced``).
The first backward outside reduces that sum together with its own gradients in one collective,
so after k micro-batches of which the first k-1 ran inside ``no_sync``

    shard_r.grad = (1/W) * sum_q sum_j g_qj[rows of r]

which is what syncing every micro-batch gives (up to the order of the additions), for the price
of holding full-size gradients between micro-batches.  FSDP1's ``no_sync`` and FSDP2's
``set_requires_gradient_sync(False)`` work the same way.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from .mixed_precision import reduce_dtype


@contextlib.contextmanager
def no_sync(module: torch.nn.Module):
    """Suppress gradient reduction in every unit of the root sharded ``module`` while inside."""
    from .sharding import unit_of, units

    root = unit_of(module)
    if root is None or not root.is_root:
        raise RuntimeError("no_sync() should only be called on the root sharded module")
    found = units(module, adopt=False)
    for u in found:
        u.sync = False
    try:
        yield
    finally:
        for u in found:
            u.sync = True


def _add(held: Optional[torch.Tensor], g: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``held + g`` where ``None`` is zero."""
    if g is None:
        return held
    return g if held is None else held + g


def hold(unit, grads) -> None:
    """Unsynced backward: ``unit.unsynced[i] += grads[i]`` in the reduce dtype (nothing is sent)."""
    cast = [None if g is None else g.to(reduce_dtype(unit.mp, g.dtype)) for g in grads]
    held = unit.unsynced or [None] * len(cast)
    unit.unsynced = [_add(h, g) for h, g in zip(held, cast)]


def merge_unsynced(unit, grads) -> list:
    """Synced backward: this backward's gradients plus what unsynced backwards held (then cleared)."""
    held, unit.unsynced = unit.unsynced, None
    if held is None:
        return list(grads)
    return [_add(h, None if g is None else g.to(h.dtype if h is not None else g.dtype))
            for h, g in zip(held, grads)]
