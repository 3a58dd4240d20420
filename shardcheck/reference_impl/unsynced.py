"""What a unit keeps between unsynced backwards (``no_sync``, accumulation.py): the sum of its full
gradients, in the reduce dtype, on the unit (``unit.unsynced``), merged into the next synced
backward's gradients before their one reduction (sharding.py, ``Unit.reduce_grads``)."""

from __future__ import annotations

from typing import Optional

import torch

from .mixed_precision import reduce_dtype


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
