"""Who communicates with whom: the strategies, and the process groups each one uses."""
from __future__ import annotations

import enum

import torch
import torch.distributed as dist

from shardcheck.strategy import Strategy


class ShardingStrategy(enum.Enum):
    """What a unit does with its parameters: the `Strategy` members a unit can take, each its value.
    SHARD_OPTIMIZER is not among them: it shards an optimizer, over NO_SHARD units (ShardedOptimizer)."""
    FULL_SHARD = Strategy.FULL_SHARD  # shard; free full params after forward, re-gather in backward
    SHARD_GRAD_OP = Strategy.SHARD_GRAD_OP  # shard; keep full params from forward until backward
    NO_SHARD = Strategy.NO_SHARD  # replicate (DDP): all-reduce gradients
    HYBRID_SHARD = Strategy.HYBRID_SHARD  # FULL_SHARD inside mesh dim 1, replicate across mesh dim 0


def groups_of(strategy, mesh, process_group):
    """(shard_group, replicate_group, dp_group) for a strategy."""
    if strategy is ShardingStrategy.HYBRID_SHARD:
        if mesh is None or mesh.ndim != 2:
            raise ValueError("HYBRID_SHARD needs a 2-D mesh (replicate, shard)")
        replicate, shard_ = mesh.get_group(0), mesh.get_group(1)
        dp = dist.group.WORLD if mesh.size() == dist.get_world_size() else mesh._flatten().get_group()
        return shard_, replicate, dp
    group = process_group or (mesh.get_group() if mesh is not None else dist.group.WORLD)
    if strategy is ShardingStrategy.NO_SHARD:
        return None, group, group
    return group, None, group


def compute_device(mesh, params) -> torch.device:
    if mesh is not None:
        if mesh.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(mesh.device_type)
    devices = [p.device for p in params if not p.is_meta]
    return devices[0] if devices else torch.device("cpu")
