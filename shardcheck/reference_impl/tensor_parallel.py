"""Tensor parallelism under the sharded units: Megatron's column- and row-parallel linears.

With ``T`` ranks in the tensor-parallel group (rank ``t``) and a plan ``{path: "colwise" | "rowwise"}``
naming ``nn.Linear`` modules, each linear keeps a slice of its weight:

* **colwise** ``Linear(i, o)``: rows ``[t*o/T, (t+1)*o/T)`` of ``W`` and of ``b``, so
  ``y_t = x W_t^T + b_t`` is this rank's slice of the output features.  Its input ``x`` is the same
  on every rank, and its gradient is the sum of every rank's part:
  ``dx = sum_t dy_t W_t`` -- identity forward, all-reduce backward (:class:`CopyToParallel`).
* **rowwise** ``Linear(i, o)``: columns ``[t*i/T, (t+1)*i/T)`` of ``W``; it takes the slice ``x_t``
  a colwise linear made and computes ``x_t W_t^T``, whose sum over ``t`` is ``x W^T``: all-reduce
  forward, identity backward (:class:`ReduceFromParallel`); the bias, whole on every rank, is added
  once, after the sum.

Every other parameter is replicated over the group, and so is its gradient (everything before a
colwise input and after a rowwise output is the same on every rank).  :func:`parallelize` runs
before :func:`~.sharding.shard`, which shards the local slices over the data-parallel group like
any parameter.  Reading the full model gathers the slices back (:func:`full`); a gradient norm
counts a sliced parameter's elements on every rank of the group and a replicated one's on its first
rank only (:func:`split_counted`, used by ``clip_grad_norm_``).  Sizes must divide by ``T``.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

DIMS = {"colwise": {"weight": 0, "bias": 0}, "rowwise": {"weight": 1}}  # the dim each parameter is sliced on


class CopyToParallel(torch.autograd.Function):
    """Identity forward; backward: ``dx = sum over the group of dx_t`` (all-reduce)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromParallel(torch.autograd.Function):
    """Forward: ``y = sum over the group of y_t`` (all-reduce); identity backward."""

    @staticmethod
    def forward(ctx, y, group):
        y = y.contiguous().clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _slice(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if t.shape[dim] % size:
        raise ValueError(f"tensor parallel: dim {dim} of size {t.shape[dim]} does not divide by {size} ranks")
    return t.detach().chunk(size, dim)[rank].clone()


def parallelize(model: nn.Module, group, plan: dict[str, str]) -> nn.Module:
    """Slice the linears of ``plan`` over ``group`` (in place; returns ``model``)."""
    for path, style in plan.items():
        linear = model.get_submodule(path)
        if style not in DIMS or not isinstance(linear, nn.Linear):
            raise ValueError(f"tensor parallel: {path} is {type(linear).__name__}, style {style!r}; "
                             f"nn.Linear and {', '.join(DIMS)} only")
        for name, dim in DIMS[style].items():
            p = getattr(linear, name)
            if p is not None:
                setattr(linear, name, nn.Parameter(_slice(p, dim, group), requires_grad=p.requires_grad))
        linear.__dict__["_tensor_parallel"] = (style, group)
        if style == "colwise":
            linear.register_forward_pre_hook(lambda m, args: (CopyToParallel.apply(args[0], group), *args[1:]))
        else:
            bias, linear.bias = linear.bias, None  # added once, after the sum
            if bias is not None:
                linear.register_parameter("bias_after_sum", bias)  # renamed back by full()
            linear.register_forward_hook(_sum_then_bias)
    return model


def _sum_then_bias(linear: nn.Linear, args, out):
    out = ReduceFromParallel.apply(out, linear.__dict__["_tensor_parallel"][1])
    bias = getattr(linear, "bias_after_sum", None)
    return out if bias is None else out + bias


def layout(module: nn.Module, name: str) -> Optional[tuple[int, object]]:
    """(the dim it is sliced on, the group) of ``module``'s parameter ``name``; None if replicated."""
    tp = module.__dict__.get("_tensor_parallel")
    if tp is None or name not in DIMS[tp[0]]:
        return None
    return DIMS[tp[0]][name], tp[1]


def full(model: nn.Module, tensors: dict[str, Optional[torch.Tensor]]) -> dict[str, Optional[torch.Tensor]]:
    """``{name: tensor}`` of the TP-local model (parameters or gradients, full over the data-parallel
    group) -> the unsharded model's: slices all-gathered and concatenated, ``bias_after_sum`` named
    ``bias`` again. Collective over each TP group (every rank holds the same names)."""
    out = {}
    for name, t in tensors.items():
        path, _, attr = name.rpartition(".")
        where = layout(model.get_submodule(path), attr) if path else None
        if where is not None and t is not None:
            dim, group = where
            parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, t.contiguous(), group=group)
            t = torch.cat(parts, dim)
        out[name.removesuffix("_after_sum") if attr == "bias_after_sum" else name] = t
    return out


def split_counted(module_params) -> tuple[list, list, object]:
    """(sliced, replicated, the TP group or None) of ``(module, name, tensor)`` triples: how a norm
    counts them (module doc)."""
    sliced, replicated, group = [], [], None
    for module, name, t in module_params:
        where = layout(module, name)
        if where is None:
            replicated.append(t)
        else:
            sliced.append(t)
            group = where[1]
    return sliced, replicated, group
