"""See the unsharded model: full parameters and gradients on every rank, for comparisons.

Names are those of ``model.named_parameters()``, which are the unsharded model's names: sharding
keeps every parameter registered where it was, only with fewer rows.  Like the forward, these
gather one flat buffer per unit (one collective), and go parameter by parameter only where a
parameter has all-gather extensions or tensor-subclass gradients.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.nn as nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from . import collectives as C
from .sharding import Unit, units


@contextlib.contextmanager
def full_params(model: nn.Module, writeback: bool = True) -> Iterator[nn.Module]:
    """Inside the block every parameter of ``model`` is the full tensor (original dtype). A tensor
    subclass shard is gathered inner tensor by inner tensor: its all-gather hooks give the value
    forward computes with (e.g. float8-quantized), not the parameter itself.

    With ``writeback`` in-place changes to a full parameter are copied back into this rank's shard
    on exit (every rank must make the same change).  Collective: call on all ranks.
    """
    gathered: list[tuple[Unit, list[nn.Parameter]]] = []
    with torch.no_grad():
        for u in units(model):
            if not u.params:
                continue
            fulls = [_gather_rows(sp.shard.detach(), sp.slot, u) if is_traceable_wrapper_subclass(sp.shard) else full
                     for full, sp in zip(u.all_gather(param_dtype=u.params[0].shard.dtype), u.params)]
            params = [nn.Parameter(f, requires_grad=sp.shard.requires_grad) for f, sp in zip(fulls, u.params)]
            for p in params:
                p._full_view = True  # not a shard: units() must not adopt it
            u.set_params(params)
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
    gathered: dict[int, torch.Tensor] = {}
    for u in units(model):
        gathered.update(gather_grads(u))
    out: dict[str, Optional[torch.Tensor]] = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            out[name] = None
        else:
            out[name] = gathered[id(p)] if id(p) in gathered else p.grad.detach().clone()
    return out


def gather_grads(unit: Unit) -> dict[int, torch.Tensor]:
    """``{id(shard): full gradient}`` for the unit's shards that have a gradient: one all-gather
    of the flat padded layout per gradient dtype, then one per inner tensor of subclass grads."""
    with_grad = [sp for sp in unit.params if sp.shard.grad is not None]
    plain = [sp for sp in with_grad if not is_traceable_wrapper_subclass(sp.shard.grad)]
    out = {}
    for dtype in dict.fromkeys(sp.shard.grad.dtype for sp in plain):
        same = [sp for sp in plain if sp.shard.grad.dtype == dtype]
        slots = [sp.slot for sp in same]
        local = C.pack_shards([sp.shard.grad.detach().to(unit.device) for sp in same], slots, dtype)
        fulls = C.unpack_full(C.all_gather_flat(local, unit.shard_group), slots, unit.shard_size)
        out.update((id(sp.shard), full) for sp, full in zip(same, fulls))
    for sp in with_grad:
        if is_traceable_wrapper_subclass(sp.shard.grad):
            out[id(sp.shard)] = _gather_rows(sp.shard.grad.detach(), sp.slot, unit)
    return out


def _gather_rows(shard: torch.Tensor, slot: C.Slot, unit: Unit) -> torch.Tensor:
    """The full tensor of one shard (a subclass: inner tensor by inner tensor)."""
    if is_traceable_wrapper_subclass(shard):
        return C.map_inner(shard, lambda t: _gather_rows(t, slot, unit), slot.shape)
    rows = shard.reshape(-1, *slot.shape[1:]).to(unit.device)
    return C.all_gather_rows(rows, slot, unit.shard_group)[: slot.rows].reshape(slot.shape).clone()
