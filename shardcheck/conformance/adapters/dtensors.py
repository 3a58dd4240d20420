"""Reading the whole value of many DTensors at once, for adapters of DTensor-based engines.

`DTensor.full_tensor()` is one collective per tensor; a model's parameters or gradients read that
way cost one all-gather each, and on a CPU machine with more ranks than cores each collective costs
milliseconds whatever its size. `full_tensors` gathers every DTensor laid out as FSDP lays out
parameters (each mesh dimension `Replicate()` or `Shard(0)`, at most one `Shard(0)`) in one
all-gather per (shard group, dtype): this rank's rows of each tensor, padded to the chunk size
``c = ceil(n / S)``, concatenated; rank ``i`` of the ``S`` ranks holds rows ``[i*c, min((i+1)*c, n))``
(`torch.chunk`'s split, which `Shard(0)` uses). Any other layout is read with `full_tensor()`.
Collective: every rank calls it with the same names, layouts and dtypes.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from shardcheck.compat import all_gather_single


def full_tensors(tensors: dict) -> dict:
    """``{name: detached copy of the whole value}`` for a dict of tensors, DTensors or None."""
    out, groups = {}, {}
    for name, t in tensors.items():
        dim = _shard_dim(t)
        if dim is None and t is not None:
            full = (t.full_tensor() if isinstance(t, DTensor) else t).detach()
            out[name] = full if is_traceable_wrapper_subclass(full) else full.clone()  # NF4 re-quantizes on clone
        elif dim is None:
            out[name] = None
        else:
            group = t.device_mesh.get_group(dim)
            groups.setdefault((group, t.dtype, t.device), []).append((name, t, t.device_mesh.get_local_rank(dim)))
    for (group, dtype, device), members in groups.items():
        out.update(_gather_rows(group, dtype, device, members))
    return {name: out[name] for name in tensors}


def _shard_dim(t) -> int | None:
    """The mesh dimension a DTensor is row-sharded on, if its layout is FSDP's; else None."""
    if not isinstance(t, DTensor) or t.numel() == 0 or is_traceable_wrapper_subclass(t.to_local()):
        return None  # empty, or a tensor subclass inside (NF4, float8: its own all-gather): full_tensor()
    placements = t.placements
    if not all(type(p) in (Replicate, Shard) for p in placements):  # _StridedShard, Partial: not here
        return None
    sharded = [i for i, p in enumerate(placements) if type(p) is Shard]
    if len(sharded) != 1 or placements[sharded[0]].dim != 0:
        return None
    return sharded[0]


def _gather_rows(group, dtype, device, members) -> dict:
    """``{name: full tensor}`` for ``members`` ((name, DTensor, this rank's index on the shard
    dimension)) of one shard group and dtype: the layout of the module docstring, one all-gather.
    Written apart from reference_impl's own gathers on purpose: a candidate's state is not read
    through the yardstick's code."""
    size = dist.get_world_size(group)
    parts, layouts = [], []
    for name, t, index in members:
        rows, row_numel = t.shape[0], math.prod(t.shape[1:])
        chunk = math.ceil(rows / size)
        local = t.to_local().detach().reshape(-1, row_numel)
        expected = max(0, min(chunk, rows - index * chunk))
        if local.shape[0] != expected:
            raise AssertionError(f"{name}: {local.shape[0]} local rows, Shard(0) of {rows} rows over {size} "
                                 f"ranks gives rank {index} {expected}")
        parts += [local.to(device).reshape(-1), local.new_zeros((chunk - expected) * row_numel, device=device)]
        layouts.append((name, t.shape, chunk))
    flat = torch.cat(parts)
    gathered = torch.empty(size * flat.numel(), dtype=dtype, device=device)
    all_gather_single(gathered, flat, group=group)
    blocks = gathered.view(size, -1).split([chunk * math.prod(shape[1:]) for _, shape, chunk in layouts], dim=1)
    return {name: block.reshape(size * chunk, *shape[1:])[: shape[0]].clone()
            for (name, shape, chunk), block in zip(layouts, blocks)}
