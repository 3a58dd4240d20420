"""Small tensor helpers the checks share."""

from __future__ import annotations

import torch


def local_part(t: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's own data of a (possibly DTensor) tensor, detached (in-place writes reach it)."""
    if t is not None and hasattr(t, "to_local"):
        t = t.to_local()
    return None if t is None else t.detach()
