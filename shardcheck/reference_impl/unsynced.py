"""What a unit keeps between the micro-batches of a step (accumulation.py).

Between unsynced backwards (``no_sync``): the sum of its full gradients, in the reduce dtype, on the
unit (``unit.unsynced``), merged into the next synced backward's gradients before their one
reduction (sharding.py, ``Unit.reduce_grads``).

After a backward with ``unit.reshard_after_backward`` False (``set_reshard_after_backward``): its
full parameters (``unit.kept``), which the next gather takes instead of all-gathering again; the
backward that reshards (the step's last) keeps nothing, so the step's update is gathered afresh.
"""

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


def keep_or_reshard(unit) -> None:
    """After a backward: keep the full parameters for the next forward, or drop them."""
    if not unit.reshard_after_backward and unit.full is not None:
        unit.kept = [None if f is None else f.detach() for f in unit.full]
    unit.reshard()
    unit.restore_shards()  # the full parameters recompute.py put on the modules for a backward, if any


def gathered(unit) -> list:
    """The unit's full parameters: those a backward kept (then no longer kept), else all-gathered."""
    kept, unit.kept = unit.kept, None
    return kept if kept is not None else unit.all_gather()
