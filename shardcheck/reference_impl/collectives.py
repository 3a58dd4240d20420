"""Collectives on *flat padded* buffers, and gradient averaging with pre/post divide factors.

Layout.  A unit with parameters ``p_1 .. p_k`` is communicated as one flat buffer.  Parameter
``p_i`` has ``n_i`` rows of ``e_i`` elements (dim-0 rows; a 0-d parameter is one row of one).
With ``ws`` ranks each rank owns ``c_i = ceil(n_i / ws)`` rows of it (``torch.chunk``): rank
``r`` holds rows ``[min(r*c_i, n_i), min((r+1)*c_i, n_i))``, so trailing ranks may hold fewer
rows or none.  Each rank's slice of ``p_i`` is zero-padded to ``c_i`` rows, so every rank
contributes ``S = sum_i c_i * e_i`` elements and the gathered buffer is ``[ws, S]``:

    rank 0: | p_1 rows 0..c_1 (padded) | p_2 rows 0..c_2 (padded) | ...
    rank 1: | p_1 rows c_1..2c_1       | p_2 rows c_2..2c_2       | ...

``all_gather_single`` fills that ``[ws, S]`` buffer from the per-rank ``[S]`` inputs, and
``reduce_scatter_single`` is its adjoint: from a ``[ws, S]`` buffer on every rank it leaves
``sum over ranks`` of row ``r`` on rank ``r``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from shardcheck.compat import all_gather_single, reduce_scatter_single


@dataclass(frozen=True)
class Slot:
    """Where one parameter lives in the flat layout (see the module docstring)."""

    shape: torch.Size  # unsharded shape
    rows: int  # n: unsharded rows (dim 0)
    row_numel: int  # e: elements per row
    chunk: int  # c = ceil(n / ws): rows per rank before padding

    @staticmethod
    def of(shape: torch.Size, ws: int) -> "Slot":
        rows = shape[0] if len(shape) > 0 else 1
        row_numel = math.prod(shape[1:]) if len(shape) > 0 else 1
        return Slot(torch.Size(shape), rows, row_numel, math.ceil(rows / ws) if rows else 0)

    def local_rows(self, rank: int) -> tuple[int, int]:
        """``[start, end)`` rows held by ``rank`` -- exactly ``torch.chunk(full, ws)[rank]``."""
        start = min(rank * self.chunk, self.rows)
        return start, min(start + self.chunk, self.rows)

    @property
    def padded_numel(self) -> int:
        return self.chunk * self.row_numel


def group_size(group) -> int:
    """World size of ``group``; ``None`` means "no group", size 1."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def shard_rows(full: torch.Tensor, slot: Slot, rank: int) -> torch.Tensor:
    """This rank's rows of ``full`` as a 2-D ``[rows, e]``-compatible tensor (a view)."""
    start, end = slot.local_rows(rank)
    return full.reshape(slot.rows, *slot.shape[1:])[start:end]


def pack_shards(shards: Sequence[torch.Tensor], slots: Sequence[Slot], dtype) -> torch.Tensor:
    """Concatenate this rank's shards, each zero-padded to ``c_i`` rows: the ``[S]`` input."""
    parts = []
    for s, slot in zip(shards, slots):
        rows = s.to(dtype).reshape(-1, slot.row_numel)
        parts.append(F.pad(rows, (0, 0, 0, slot.chunk - rows.shape[0])).reshape(-1))
    return torch.cat(parts) if parts else torch.empty(0, dtype=dtype)


def pack_full(fulls: Sequence[Optional[torch.Tensor]], slots: Sequence[Slot], ws: int, dtype, device) -> torch.Tensor:
    """Lay full tensors out as the ``[ws * S]`` buffer (``None`` = zeros): reduce-scatter input.

    One buffer, each gradient copied (cast) into its place: the gradients and the buffer are alive
    at once, no third copy (a padded copy of each gradient concatenated would hold the unit's
    gradients three times during the reduction)."""
    flat = torch.zeros(ws, sum(s.padded_numel for s in slots), dtype=dtype, device=device)
    for t, slot, block in zip(fulls, slots, flat.split([s.padded_numel for s in slots], dim=1)):
        if t is None or slot.padded_numel == 0:
            continue
        rows, into = t.reshape(slot.rows, slot.row_numel), block.view(ws, slot.chunk, slot.row_numel)
        whole = slot.rows // slot.chunk  # ranks whose chunk is all rows; the next one holds the rest
        into[:whole].copy_(rows[: whole * slot.chunk].view(whole, slot.chunk, slot.row_numel))
        if whole < ws:
            into[whole, : slot.rows - whole * slot.chunk].copy_(rows[whole * slot.chunk:])
    return flat.view(-1)


def unpack_full(flat: torch.Tensor, slots: Sequence[Slot], ws: int) -> list[torch.Tensor]:
    """Inverse of :func:`pack_full`: cut the gathered ``[ws * S]`` buffer into full tensors."""
    blocks = flat.view(ws, -1).split([s.padded_numel for s in slots], dim=1)
    return [b.reshape(ws * s.chunk, s.row_numel)[: s.rows].view(s.shape) for b, s in zip(blocks, slots)]


def unpack_shards(flat: torch.Tensor, slots: Sequence[Slot], rank: int) -> list[torch.Tensor]:
    """Cut this rank's ``[S]`` buffer into unpadded shards of shape ``[local rows, *shape[1:]]``."""
    out = []
    for part, s in zip(flat.split([s.padded_numel for s in slots]), slots):
        start, end = s.local_rows(rank)
        out.append(part.view(s.chunk, s.row_numel)[: end - start].view(end - start, *s.shape[1:]))
    return out


def map_inner(t: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor], shape: torch.Size) -> torch.Tensor:
    """A wrapper tensor subclass (e.g. ``TwoTensor``) of ``shape`` whose inner tensors are ``fn`` of
    ``t``'s: how a subclass shard or gradient is communicated, one inner tensor at a time."""
    names, ctx = t.__tensor_flatten__()
    inner = {n: fn(getattr(t, n)) for n in names}
    return type(t).__tensor_unflatten__(inner, ctx, shape, torch.empty(shape, device="meta").stride())


def all_gather_rows_many(xs: Sequence[torch.Tensor], slots: Sequence[Slot], group) -> list[torch.Tensor]:
    """All-gather dim-0 sharded tensors that cannot travel in a unit's flat buffer (extension
    inputs, subclass inner tensors): each ``x_i`` is padded to ``c_i`` rows (``slots[i].chunk``;
    more rows are cut), flattened and concatenated, one all-gather per dtype on the wire (a float8
    tensor travels as its bytes: gloo and ``F.pad`` have no float8 types).  Returns each as
    ``[ws * c_i, *x_i.shape[1:]]``; the caller keeps the first ``n_i`` rows."""
    ws = group_size(group)
    out: list[Optional[torch.Tensor]] = [None] * len(xs)
    by_wire: dict = {}
    for i, x in enumerate(xs):
        wire = torch.uint8 if x.dtype.is_floating_point and x.dtype.itemsize == 1 else x.dtype
        by_wire.setdefault(wire, []).append(i)
    for wire, members in by_wire.items():
        rows = [xs[i].view(wire).reshape(xs[i].shape[0], math.prod(xs[i].shape[1:])) for i in members]
        local = torch.cat([F.pad(r, (0, 0, 0, slots[i].chunk - r.shape[0])).reshape(-1) for r, i in zip(rows, members)])
        blocks = all_gather_flat(local, group).view(ws, -1).split([slots[i].chunk * r.shape[1] for r, i in zip(rows, members)], dim=1)
        for i, block in zip(members, blocks):
            out[i] = block.reshape(ws * slots[i].chunk, *xs[i].shape[1:]).view(xs[i].dtype).clone(
                memory_format=torch.contiguous_format)  # its own storage, as a separate all-gather's output
    return out


def all_gather_flat_many(locals_: Sequence[torch.Tensor], group) -> list[torch.Tensor]:
    """``[all_gather_flat(x, group) for x in locals_]`` in one collective (one dtype and device):
    each rank sends its buffers end to end, and the gathered ``[ws, sum_i S_i]`` is cut back into
    the ``[ws * S_i]`` buffers."""
    if len(locals_) == 1:
        return [all_gather_flat(locals_[0], group)]
    flat = all_gather_flat(torch.cat([x.reshape(-1) for x in locals_]), group)
    blocks = flat.view(group_size(group), -1).split([x.numel() for x in locals_], dim=1)
    return [block.reshape(-1) for block in blocks]


def all_gather_full(shards: Sequence[torch.Tensor], slots: Sequence[Slot], dtype, device, group,
                    alias: bool = True) -> list[torch.Tensor]:
    """The full tensors of a unit's plain ``shards``, in ``dtype`` on ``device``: one all-gather of
    the flat padded layout. In a group of one, shards already in ``dtype`` on ``device`` are the
    full tensors, used as they are (viewed in their full shapes): a copy would hold the unit twice
    from its forward to its backward (NO_SHARD keeps it gathered), with the same values. Not when
    ``alias`` is False (shards offloaded to the host: the compute device is another device on a
    GPU, the same CPU only here)."""
    ws = group_size(group)
    if alias and ws == 1 and all(not is_traceable_wrapper_subclass(s) and s.dtype == dtype and s.device == device for s in shards):
        return [s.view(slot.shape) for s, slot in zip(shards, slots)]
    local = pack_shards([s.to(device) for s in shards], slots, dtype)
    return unpack_full(all_gather_flat(local, group), slots, ws)


def all_gather_flat(local: torch.Tensor, group) -> torch.Tensor:
    """``out[r * S:(r + 1) * S] = local_r`` for every rank ``r`` of ``group``."""
    ws = group_size(group)
    if ws == 1:
        return local
    out = torch.empty(ws * local.numel(), dtype=local.dtype, device=local.device)
    all_gather_single(out, local.contiguous(), group=group)
    return out


def predivide_factor(world_size: int) -> float:
    """The pre-division factor ``f`` of torch's ``DefaultState``: start at 1 and double while
    ``ws % f == 0 and ws / f > f`` (roughly ``sqrt(ws)``; e.g. ws=2 -> 2, 4 -> 2, 8 -> 4).

    Averaging as ``(sum_r g_r / f) / (ws / f)`` keeps low-precision sums in range: dividing by
    ``f ~ sqrt(ws)`` before the sum avoids fp16 overflow, dividing by the rest after it avoids
    underflow.  Overall the result is ``sum_r g_r / ws``.
    """
    factor = 1
    while world_size % factor == 0 and world_size / factor > factor:
        factor *= 2
    return float(factor)


def divide_factors(world_size: int, factor: Optional[float] = None) -> tuple[float, float]:
    """``(pre, post)`` with ``pre * post = d``, the whole divisor: ``d = world_size``, or the user's
    ``factor`` (``set_gradient_divide_factor``) when given; ``pre = predivide_factor(d)`` (1 for a
    ``d`` the loop stops early on, e.g. 3.0 -> (2, 1.5); ``post`` may be below 1)."""
    total = float(world_size if factor is None else factor)
    pre = predivide_factor(total)
    return pre, total / pre


def average_gradient(flat: torch.Tensor, shard_group, replicate_group, factor: Optional[float] = None) -> torch.Tensor:
    """Average the ``[sws * S]`` local gradient buffer over all data-parallel ranks.

    ``out = post( all_reduce_R( reduce_scatter_G( pre(flat) ) ) )`` where ``G`` is the shard group
    (size ``sws``), ``R`` the replicate group (size ``rws``), ``pre(x) = x / f``,
    ``post(x) = x / (d / f)``, ``d = sws * rws`` and ``f = predivide_factor(d)``; so this rank gets
    ``(1 / d) * sum over all ranks`` of its ``[S]`` slice of the buffer.  With a user ``factor``
    ``d = factor``: the sum over BOTH groups divided by it once (FSDP2's ``set_gradient_divide_factor``:
    its reduce-scatter pre-multiplies by ``1 / factor`` and its all-reduce sums), whatever the mesh's
    shape, a dimension of size 1 included.
    """
    sws, rws = group_size(shard_group), group_size(replicate_group)
    pre, post = divide_factors(sws * rws, factor)
    if pre != 1:
        flat.div_(pre)  # in place: `flat` is the caller's fresh buffer (pack_full), not a gradient
    if sws > 1:
        out = torch.empty(flat.numel() // sws, dtype=flat.dtype, device=flat.device)
        reduce_scatter_single(out, flat, group=shard_group)
    else:
        out = flat
    if rws > 1:
        dist.all_reduce(out, group=replicate_group)
    if post != 1:
        out.div_(post)
    return out
