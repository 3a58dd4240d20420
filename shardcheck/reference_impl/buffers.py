"""Buffers, kept as DDP keeps them (``broadcast_buffers``).

A unit shards its parameters, not its buffers: every rank holds each buffer whole, and a training
forward updates it from that rank's batch alone (BatchNorm's running statistics).  So that every
rank evaluates, saves and goes on with the same values, the root broadcasts every buffer of the
model from the first rank of its data-parallel group before a forward, when the forward before it
was a training forward whose gradients are synced (and before the very first):

    b <- b_0        (one broadcast per dtype)

This is DDP's rule exactly (``DistributedDataParallel._pre_forward``/``_post_forward``): after an
evaluation or a ``no_sync`` forward the next forward does not broadcast.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn


def broadcast_(module: nn.Module, group) -> None:
    """Every buffer of ``module`` takes the value of ``group``'s first rank (one broadcast per dtype)."""
    buckets: dict = {}
    for b in module.buffers():
        buckets.setdefault((b.dtype, b.device), []).append(b)
    if not buckets or group is None or dist.get_world_size(group) == 1:
        return
    source = dist.get_global_rank(group, 0)
    with torch.no_grad():
        for bs in buckets.values():
            flat = torch.cat([b.reshape(-1) for b in bs])
            dist.broadcast(flat, src=source, group=group)
            for b, part in zip(bs, flat.split([b.numel() for b in bs])):
                b.copy_(part.view_as(b))


def before_forward(unit) -> None:
    """Before a unit's forward: the root broadcasts when the last forward was a synced training one."""
    if unit.is_root and unit.__dict__.get("buffers_stale", True):
        broadcast_(unit.module, unit.dp_group)


def after_forward(unit) -> None:
    """After a unit's forward: the root notes whether the next forward must broadcast."""
    if unit.is_root:
        unit.buffers_stale = torch.is_grad_enabled() and unit.sync
