"""The two ways a check reads a (possibly DTensor) tensor: this rank's own data, or the whole value.

`local_part` is local and free; `full_value` of a DTensor is a collective (every rank must call it).
Both return detached tensors and pass plain tensors and None through.
"""

from __future__ import annotations

import torch


def local_part(t: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's own data of a (possibly DTensor) tensor, detached (in-place writes reach it)."""
    if t is not None and hasattr(t, "to_local"):
        t = t.to_local()
    return None if t is None else t.detach()


def full_value(t):
    """The whole value of a (possibly DTensor) tensor, detached: a DTensor is all-gathered
    (`full_tensor()`, a collective), a plain tensor is itself; anything else comes back unchanged."""
    if t is not None and hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.detach() if isinstance(t, torch.Tensor) else t
