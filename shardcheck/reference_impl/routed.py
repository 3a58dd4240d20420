"""Gradients some ranks lack: ``set_reduce_unused(root, True)`` (a mixture of experts' experts).

A parameter this rank's forward never used (an expert this rank's router sent no token to) has no
gradient here, while another rank's forward used it. The reduction already counts a missing gradient
as zeros (``collectives.pack_full``), so every rank's shard receives ``(1/W) * sum`` over the ranks
that used it; what a rank cannot tell alone is whether to keep that shard gradient or to leave it
None because no rank used the parameter (torch's optimizers skip a None gradient: AdamW neither
decays the parameter nor advances its moments). DDP answers it, under ``find_unused_parameters=True``,
by all-reducing its map of locally used parameters; a unit with ``reduce_unused`` set does the same:
one all-reduce of one flag per parameter over the data-parallel ranks, with each reduction. Without
it a gradient missing here stays None after the reduction, which is right only when every rank
misses it alike (parameters no forward ever uses), so it is off by default, as DDP's flag is.
The agreement happens in a unit's backward, so a unit must run one on every rank: the unit holding
the experts holds their router too (a MoE block, a decoder layer), which every rank's tokens use.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def used_anywhere(unit, local: list[bool]) -> list[bool]:
    """Per parameter, whether some data-parallel rank has a gradient for it (``local``: this rank's
    flags); ``local`` itself when the unit does not agree them (``reduce_unused`` off)."""
    if not unit.reduce_unused:
        return local
    flags = torch.tensor(local, dtype=torch.int32, device=unit.device)
    dist.all_reduce(flags, group=unit.dp_group)
    return [bool(f) for f in flags.tolist()]


def set_reduce_unused(module: torch.nn.Module, flag: bool) -> None:
    """Whether every unit under ``module`` agrees, with each reduction, which parameters some rank
    has a gradient for (module doc)."""
    from .sharding import units

    for u in units(module, adopt=False):
        u.reduce_unused = flag
