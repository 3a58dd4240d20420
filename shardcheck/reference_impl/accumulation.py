"""Gradient accumulation without communication: ``no_sync``.

Inside ``no_sync(root)`` a unit's backward does not reduce: each rank keeps its full (unsharded)
gradients, summed over the micro-batches, in the reduce dtype, on the unit (``unit.unsynced``).
The first backward outside reduces that sum together with its own gradients in one collective,
so after k micro-batches of which the first k-1 ran inside ``no_sync``

    shard_r.grad = (1/W) * sum_q sum_j g_qj[rows of r]

which is what syncing every micro-batch gives (up to the order of the additions), for the price
of holding full-size gradients between micro-batches.  FSDP1's ``no_sync`` and FSDP2's
``set_requires_gradient_sync(False)`` work the same way.

``set_reshard_after_backward(root, False)`` keeps each unit's full parameters after backward for
the next forward (no all-gather), as FSDP2's of that name; True again before a step's last backward,
so that the step's update is gathered afresh (unsynced.py).
"""
from __future__ import annotations

import contextlib

import torch

from .sharding import unit_of, units


@contextlib.contextmanager
def no_sync(module: torch.nn.Module):
    """Suppress gradient reduction in every unit of the root sharded ``module`` while inside."""
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


def set_reshard_after_backward(module: torch.nn.Module, flag: bool) -> None:
    """Whether the next backwards of every unit under ``module`` reshard the parameters (False: kept
    gathered for the next forward)."""
    for u in units(module, adopt=False):
        u.reshard_after_backward = flag
