"""A model held by one rank, given to every rank: how the reference loads saved weights memory-efficiently.

The front-ends load a pretrained model on rank 0 alone and build a skeleton on the meta device on the
other ranks (Accelerate's ``fsdp_cpu_ram_efficient_loading``, FSDP1's ``sync_module_states``). After
``shard`` and ``to_empty`` the other ranks hold storage with no values: ``fill_from_rank0`` gives
every rank rank 0's values, all of them: every parameter (written into this rank's shard) and every
buffer, the non-persistent ones too (rotary embeddings' ``inv_freq`` is in no state dict: a loader
that broadcasts the state dict alone leaves it as ``to_empty`` left it). Tied parameters are one
parameter and are filled once.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from . import collectives as C
from .sharding import units


def held(model: nn.Module) -> dict[str, torch.Tensor]:
    """What rank 0 gives: a copy of every parameter and buffer of its (unsharded) model, by name."""
    return {n: t.detach().clone() for n, t in (*model.named_parameters(), *model.named_buffers())}


def non_persistent(model: nn.Module) -> set[str]:
    """The names of the buffers ``state_dict`` leaves out."""
    return {f"{path}.{name}".lstrip(".") for path, m in model.named_modules() for name in m._non_persistent_buffers_set}


@torch.no_grad()
def fill_from_rank0(model: nn.Module, values: Optional[dict[str, torch.Tensor]]) -> None:
    """Every rank's parameters and buffers of the sharded ``model`` set to rank 0's ``values``
    (``held`` on rank 0; None on the others), one broadcast per tensor over the data-parallel group:
    a parameter's full value, of which each rank keeps its own rows (its shard), and each buffer
    whole (buffers are not sharded). Collective."""
    group = units(model, adopt=False)[0].dp_group
    source = dist.get_global_rank(group, 0) if group is not None else 0
    by_id = {id(sp.shard): (u, sp) for u in units(model) for sp in u.params}
    for name, p in model.named_parameters():
        unit, sp = by_id[id(p)]
        full = values[name].to(p.device, p.dtype).contiguous() if values is not None else p.new_empty(sp.slot.shape)
        dist.broadcast(full, src=source, group=group)
        p.copy_(C.shard_rows(full, sp.slot, unit.shard_rank))
    for name, b in model.named_buffers():
        if values is not None:
            b.copy_(values[name])
        dist.broadcast(b, src=source, group=group)
