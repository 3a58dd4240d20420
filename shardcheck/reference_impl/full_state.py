"""See the unsharded model: full parameters and gradients on every rank, for comparisons.

Names are those of ``model.named_parameters()``, which are the unsharded model's names: sharding
keeps every parameter registered where it was, only with fewer rows.  These gather each unit's
flat buffer as the forward does, the buffers of all units in one collective per shard group and
dtype, and go parameter by parameter only where a parameter has all-gather extensions or
tensor-subclass gradients.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.nn as nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from . import collectives as C, tensor_parallel
from .extensions import has_extension
from .sharding import Unit, units


@contextlib.contextmanager
def full_params(model: nn.Module, writeback: bool = True) -> Iterator[nn.Module]:
    """Inside the block every parameter of ``model`` is the full tensor (original dtype). A tensor
    subclass shard is gathered inner tensor by inner tensor: its all-gather hooks give the value
    forward computes with (e.g. float8-quantized), not the parameter itself.

    With ``writeback`` in-place changes to a full parameter are copied back into this rank's shard
    on exit (every rank must make the same change).  Collective: call on all ranks.
    """
    gathered: list[tuple[Unit, list[Optional[torch.Tensor]], list[str]]] = []
    views: list[tuple[Unit, list[nn.Parameter]]] = []
    with torch.no_grad():
        for u in units(model):
            if u.params:
                kinds = [_kind(sp.shard) for sp in u.params]
                fulls = u.all_gather(param_dtype=u.params[0].shard.dtype, skip=[k != "hooked" for k in kinds])
                gathered.append((u, fulls, kinds))
        plain = _gather_units([(u, *_select(u, kinds, "plain", lambda t: t), u.params[0].shard.dtype)
                               for u, _, kinds in gathered])
        subclass = _gather_subclasses([(u, *_select(u, kinds, "subclass", torch.Tensor.detach))
                                       for u, _, kinds in gathered])
        for (u, fulls, kinds), from_plain, from_subclass in zip(gathered, plain, subclass):
            rest = {"plain": iter(from_plain), "subclass": iter(from_subclass)}
            fulls = [next(rest[k]) if k in rest else full for full, k in zip(fulls, kinds)]
            params = [nn.Parameter(f, requires_grad=sp.shard.requires_grad) for f, sp in zip(fulls, u.params)]
            for p in params:
                p._full_view = True  # not a shard: units() must not adopt it
            u.set_params(params)
            views.append((u, params))
    try:
        yield model
    finally:
        with torch.no_grad():
            for u, params in views:
                for sp, full in zip(u.params, params):
                    if writeback and sp.extension is None:
                        sp.shard.copy_(C.shard_rows(full, sp.slot, u.shard_rank))
                u.restore_shards()


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{name: full parameter}`` (detached copies, original dtype) on every rank."""
    with full_params(model, writeback=False):
        local = {n: p.detach().clone() for n, p in model.named_parameters()}
    return tensor_parallel.full(model, local)  # TP slices gathered (tensor_parallel.py)


def full_grads(model: nn.Module) -> dict[str, Optional[torch.Tensor]]:
    """``{name: full averaged gradient or None}`` on every rank (all-gathers the shard grads).

    ``None`` where the shard's grad is ``None``; that is the same on every rank because every rank
    runs the same backward graph.
    """
    plain_jobs, plain_owners, subclass_jobs, subclass_owners = [], [], [], []
    for u in units(model):
        with_grad = [sp for sp in u.params if sp.shard.grad is not None]
        plain = [sp for sp in with_grad if not is_traceable_wrapper_subclass(sp.shard.grad)]
        for dtype in dict.fromkeys(sp.shard.grad.dtype for sp in plain):
            same = [sp for sp in plain if sp.shard.grad.dtype == dtype]
            plain_jobs.append((u, [sp.shard.grad.detach() for sp in same], [sp.slot for sp in same], dtype))
            plain_owners.append(same)
        subclass = [sp for sp in with_grad if is_traceable_wrapper_subclass(sp.shard.grad)]
        subclass_jobs.append((u, [sp.shard.grad.detach() for sp in subclass], [sp.slot for sp in subclass]))
        subclass_owners.append(subclass)
    gathered: dict[int, torch.Tensor] = {}
    for owners, fulls_per_job in ((plain_owners, _gather_units(plain_jobs)),
                                  (subclass_owners, _gather_subclasses(subclass_jobs))):
        for owner, fulls in zip(owners, fulls_per_job):
            gathered.update((id(sp.shard), full) for sp, full in zip(owner, fulls))
    out: dict[str, Optional[torch.Tensor]] = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            out[name] = None
        else:
            out[name] = gathered[id(p)] if id(p) in gathered else p.grad.detach().clone()
    return tensor_parallel.full(model, out)


def _kind(shard: torch.Tensor) -> str:
    """How full_params gathers a shard: "subclass" (inner tensor by inner tensor), "hooked" (through
    its all-gather extension) or "plain" (in its unit's flat buffer)."""
    if is_traceable_wrapper_subclass(shard):
        return "subclass"
    return "hooked" if has_extension(shard) else "plain"


def _select(u: Unit, kinds: list[str], kind: str, view) -> tuple[list[torch.Tensor], list[C.Slot]]:
    """``view`` of the unit's shards of ``kind``, and their slots."""
    chosen = [sp for sp, k in zip(u.params, kinds) if k == kind]
    return [view(sp.shard) for sp in chosen], [sp.slot for sp in chosen]


def _gather_units(jobs: list[tuple[Unit, list[torch.Tensor], list[C.Slot], torch.dtype]]) -> list[list[torch.Tensor]]:
    """For each ``(unit, shards, slots, dtype)``: the full tensors of the shards, in ``dtype``.

    Each unit's shards form its flat padded layout (as in forward), and the layouts of every unit
    with the same shard group, dtype and device travel in one all-gather: a read of the whole
    model's state is one collective, not one per unit."""
    out: list[list[torch.Tensor]] = [[] for _ in jobs]
    by_wire: dict = {}
    for j, (u, shards, _, dtype) in enumerate(jobs):
        if shards:
            by_wire.setdefault((u.shard_group, dtype, u.device), []).append(j)
    for (group, dtype, device), members in by_wire.items():
        local = [C.pack_shards([s.to(device) for s in jobs[j][1]], jobs[j][2], dtype) for j in members]
        for j, flat in zip(members, C.all_gather_flat_many(local, group)):
            out[j] = C.unpack_full(flat, jobs[j][2], jobs[j][0].shard_size)
    return out


def _leaves(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors inside a (possibly nested) wrapper subclass, in ``__tensor_flatten__`` order."""
    if not is_traceable_wrapper_subclass(t):
        return [t]
    return [leaf for name in t.__tensor_flatten__()[0] for leaf in _leaves(getattr(t, name))]


def _rebuild(t: torch.Tensor, fulls, shape: torch.Size) -> torch.Tensor:
    """``t``'s subclass structure of ``shape`` around the next tensors of the iterator ``fulls``."""
    if not is_traceable_wrapper_subclass(t):
        return next(fulls)
    return C.map_inner(t, lambda inner: _rebuild(inner, fulls, shape), shape)


def _gather_subclasses(jobs: list[tuple[Unit, list[torch.Tensor], list[C.Slot]]]) -> list[list[torch.Tensor]]:
    """For each ``(unit, shards, slots)`` of subclass shards (e.g. TwoTensor): their full tensors,
    inner tensor by inner tensor (each is sharded on rows like its parameter). The inner tensors of
    every unit with the same shard group and device travel in one all-gather per dtype."""
    out: list[list[torch.Tensor]] = [[] for _ in jobs]
    by_group: dict = {}
    for j, (u, _, _) in enumerate(jobs):
        by_group.setdefault((u.shard_group, u.device), []).append(j)
    for (group, device), members in by_group.items():
        leaves = [(leaf.reshape(-1, *slot.shape[1:]).to(device), slot) for j in members
                  for shard, slot in zip(jobs[j][1], jobs[j][2]) for leaf in _leaves(shard)]
        if not leaves:
            continue
        gathered = C.all_gather_rows_many([x for x, _ in leaves], [s for _, s in leaves], group)
        fulls = iter(g[: slot.rows].reshape(slot.shape).clone() for g, (_, slot) in zip(gathered, leaves))
        for j in members:
            out[j] = [_rebuild(shard, fulls, slot.shape) for shard, slot in zip(jobs[j][1], jobs[j][2])]
    return out
