"""``clip_grad_norm_`` over sharded and replicated gradients with one all-reduce.

For ``p < inf`` the total norm is ``(sum over every gradient element x of |x|^p)^(1/p)``.  Each rank
adds ``|x|^p`` over the elements it *counts*: all of its shards' elements for sharded units, and
for replicated copies (NO_SHARD, the replicas of HYBRID_SHARD) only where it is the first replica,
so every element is counted exactly once.  One ``all_reduce(SUM)`` of the local sums then gives
``total^p``.  For ``p = inf`` it is one ``all_reduce(MAX)`` of the local maxima.  Under tensor
parallelism (tensor_parallel.py) a second all-reduce over the TP group adds the TP slices, each
replicated parameter counted on the group's first rank only.  Gradients are then
scaled by ``min(1, max_norm / (total + 1e-6))`` on device, without a host sync, as torch does.
"""
from __future__ import annotations

import functools
import math
import warnings

import torch
import torch.distributed as dist

from . import tensor_parallel
from .sharding import unit_of, units


@torch.no_grad()
def clip_grad_norm_(module: torch.nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip the gradients of the root sharded ``module`` in place; return the total norm.

    The norm is computed in float32 and returned in the gradients' (promoted) dtype; a rank with no
    gradients warns and returns it in float32 (it still joins the all-reduce).
    """
    root = unit_of(module)
    if root is None or not root.is_root:
        raise RuntimeError("clip_grad_norm_() should only be called on the root sharded module")
    norm_type = float(norm_type)
    all_grads, counted = [], []
    for u in units(module):
        with_grad = [sp for sp in u.params if sp.shard.grad is not None]
        all_grads += [sp.shard.grad for sp in with_grad]
        if u.first_replica:
            counted += [(*sp.uses[0], sp.shard.grad) for sp in with_grad]
    sliced, replicated, tp_group = tensor_parallel.split_counted(counted)
    if tp_group is not None and dist.get_rank(tp_group) != 0:
        replicated = []  # the same on every rank of the TP group: counted on its first rank
    device = all_grads[0].device if all_grads else root.device
    local = _local_norm(sliced + replicated, norm_type, device)
    op = dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM
    for group in (root.dp_group, tp_group) if tp_group is not None else (root.dp_group,):
        dist.all_reduce(local, op=op, group=group)
    total = local if norm_type == math.inf else local ** (1.0 / norm_type)
    clip_coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in all_grads:
        g.mul_(clip_coef.to(g.device, g.dtype))
    if not all_grads:
        warnings.warn(
            f"Called FSDP.clip_grad_norm_() on rank {dist.get_rank(root.dp_group)} with no gradients -- returning the "
            f"total norm in the default dtype {total.dtype}"
        )
        return total
    return total.to(functools.reduce(torch.promote_types, [g.dtype for g in all_grads]))


def _local_norm(grads, norm_type: float, device) -> torch.Tensor:
    """This rank's contribution in float32: ``max |x|`` for inf, else ``sum |x|^p``."""
    grads = [g for g in grads if g.numel() > 0]  # empty shards (trailing ranks) add nothing
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch.stack([torch.linalg.vector_norm(g, norm_type, dtype=torch.float32).to(device) for g in grads])
    if norm_type == math.inf:
        return norms.max()
    return (norms ** norm_type).sum()
