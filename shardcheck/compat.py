"""What differs between the torch releases shardcheck runs on, in one place.

shardcheck judges the torch it finds (``torch>=2.9``, never replaced). Where a release renamed an
API the suite itself uses, the name used everywhere is defined here once, for every release.
Adapters keep their own engine's release differences in their own module.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["all_gather_single", "reduce_scatter_single", "set_grad", "innermost_saved_tensors_pack", "in_backward"]


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group: Any = None, async_op: bool = False) -> Any:
    """``output = cat_r(input_r)`` (or its ``[ws, ...]`` stack) over the ranks of ``group``.

    torch 2.13 named it ``all_gather_single``; before, ``all_gather_into_tensor`` (deprecated since).
    """
    op = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return op(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
    """``output = (sum_r input_r)[rank]``: the adjoint of `all_gather_single`.

    torch 2.13 named it ``reduce_scatter_single``; before, ``reduce_scatter_tensor``.
    """
    collective = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return collective(output, input, op=op, group=group, async_op=async_op)


def set_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    """``param.grad = grad``, also where ``grad``'s dtype or device is not ``param``'s (gradients kept
    in low precision, or offloaded).

    Releases before 2.10 refuse that assignment; there the gradient goes in through ``.data`` behind
    a zero-stride placeholder of ``param``'s dtype and device (no allocation), as FSDP1 does.
    """
    try:
        param.grad = grad
    except RuntimeError:
        if grad.shape != param.shape:
            raise
        param.grad = torch.zeros((), dtype=param.dtype, device=param.device).expand_as(param)
        param.grad.data = grad


def innermost_saved_tensors_pack():
    """The pack function of the innermost active ``torch.autograd.graph.saved_tensors_hooks`` (what
    autograd will call for the next tensor saved for backward), or None when none is active: how a
    forward learns that something else (activation checkpointing) already decides what is kept."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return None if top is None else top[0]


def in_backward() -> bool:
    """Whether the autograd engine is running a backward on this thread (a forward called now is a
    recomputation: activation checkpointing)."""
    return torch._C._current_graph_task_id() != -1
