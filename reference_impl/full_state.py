"""See the unsharded model: full parameters and gradients on every rank, for comparisons.

Names are those of ``model.named_parameters()``, which are the unsharded model's names: sharding
keeps every parameter registered where it was, only with fewer rows.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.nn as nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from . import collectives as C
from .extensions import gather_rows
from .sharding import ShardedParam, Unit, units


@contextlib.contextmanager
def full_params(model: nn.Module, writeback: bool = True) -> Iterator[nn.Module]:
    """Inside the block every parameter of ``model`` is the full tensor (original dtype).

    With ``writeback`` in-place changes to a full parameter are copied back into this rank's shard
    on exit (every rank must make the same change).  Collective: call on all ranks.
    """
    gathered: list[tuple[Unit, list[nn.Parameter]]] = []
    with torch.no_grad():
        for u in units(model):
            fulls = u.all_gather(param_dtype=u.params[0].shard.dtype if u.params else None) if u.params else []
            params = [nn.Parameter(f, requires_grad=sp.shard.requires_grad) for f, sp in zip(fulls, u.params)]
            for p in params:
                p._full_view = True  # not a shard: units() must not adopt it
            u.install(params)
            gathered.append((u, params))
    try:
        yield model
    finally:
        with torch.no_grad():
            for u, params in gathered:
                for sp, full in zip(u.params, params):
                    if writeback and sp.extension is None:
                        sp.shard.copy_(C.shard_rows(full, sp.slot, u.shard_rank))
                u.restore_shards()


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{name: full parameter}`` (detached copies, original dtype) on every rank."""
    with full_params(model, writeback=False):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def full_grads(model: nn.Module) -> dict[str, Optional[torch.Tensor]]:
    """``{name: full averaged gradient or None}`` on every rank (all-gathers the shard grads).

    ``None`` where the shard's grad is ``None``; that is the same on every rank because every rank
    runs the same backward graph.
    """
    owner: dict[int, tuple[Unit, ShardedParam]] = {id(sp.shard): (u, sp) for u in units(model) for sp in u.params}
    out: dict[str, Optional[torch.Tensor]] = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            out[name] = None
        elif id(p) not in owner:
            out[name] = p.grad.detach().clone()
        else:
            u, sp = owner[id(p)]
            out[name] = _gather(p.grad.detach(), sp.slot, u)
    return out


def _gather(shard: torch.Tensor, slot: C.Slot, unit: Unit) -> torch.Tensor:
    if is_traceable_wrapper_subclass(shard):
        names, ctx = shard.__tensor_flatten__()
        inner = {n: _gather(getattr(shard, n), slot, unit) for n in names}
        return type(shard).__tensor_unflatten__(inner, ctx, slot.shape, torch.empty(slot.shape, device="meta").stride())
    rows = shard.reshape(-1, *slot.shape[1:]).to(unit.device)
    return gather_rows(rows, slot, unit.shard_group)[: slot.rows].reshape(slot.shape).clone()
