"""Gradient communication hooks (FSDP1's ``register_comm_hook``), working on CPU and CUDA.

A hook replaces a unit's gradient collective.  It receives the unit's flat gradient buffer:

* ``NO_SHARD``: ``hook(state, grad)`` must leave the averaged gradient in ``grad`` (all-reduce);
* sharded strategies: ``hook(state, grad, output)`` gets the ``[ws * S]`` padded full gradient and
  must write this rank's averaged ``[S]`` shard into ``output`` (reduce-scatter).

The built-ins average with the two-step division of :class:`DefaultState`:
``g_avg = (sum_r (g_r / pre)) / post`` with ``pre * post = world_size`` (see
:func:`shardcheck.reference_impl.collectives.predivide_factor`).  The compression hooks communicate in fp16 /
bf16 and copy the result back into the caller's (``state.parameter_type``) buffer.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from shardcheck.compat import reduce_scatter_single

from .collectives import predivide_factor
from .sharding import ShardingStrategy, unit_of, units


class DefaultState:
    """Process group and the pre/post division factors: ``pre = predivide_factor(ws)``,
    ``post = ws / pre``."""

    __slots__ = ["process_group", "world_size", "gradient_predivide_factor", "gradient_postdivide_factor"]

    def __init__(self, process_group):
        if process_group is None:
            raise ValueError(f"Expected to pass in an explicit ProcessGroup to {self}.")
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.gradient_predivide_factor = predivide_factor(self.world_size)
        self.gradient_postdivide_factor = self.world_size / self.gradient_predivide_factor


class LowPrecisionState(DefaultState):
    """:class:`DefaultState` plus ``parameter_type``, the dtype gradients are decompressed to."""

    __slots__ = ["parameter_type"]

    def __init__(self, process_group, parameter_type: torch.dtype = torch.float32):
        super().__init__(process_group)
        self.parameter_type = parameter_type


def allreduce_hook(state: DefaultState, grad: torch.Tensor) -> None:
    """``grad <- (all_reduce_sum(grad / pre)) / post = mean over ranks of grad`` (in place)."""
    if state.gradient_predivide_factor > 1:
        grad.div_(state.gradient_predivide_factor)
    dist.all_reduce(grad, group=state.process_group)
    if state.gradient_postdivide_factor > 1:
        grad.div_(state.gradient_postdivide_factor)


def reduce_scatter_hook(state: DefaultState, grad: torch.Tensor, output: torch.Tensor) -> None:
    """``output <- (reduce_scatter_sum(grad / pre))[rank] / post`` = this rank's slice of the mean."""
    if state.gradient_predivide_factor > 1:
        grad.div_(state.gradient_predivide_factor)
    reduce_scatter_single(output, grad, group=state.process_group)
    if state.gradient_postdivide_factor > 1:
        output.div_(state.gradient_postdivide_factor)


def _low_precision_hook(prec: torch.dtype, state: LowPrecisionState, grad: torch.Tensor, output: Optional[torch.Tensor]) -> None:
    """Compress to ``prec``, run the default hook, decompress by copying into ``grad``/``output``.

    Unlike torch's version this never swaps ``.data`` nor calls ``record_stream`` (which fails on
    CPU); the caller's buffer keeps its dtype (``state.parameter_type`` in FSDP use)."""
    compressed = grad.to(prec)
    if output is None:
        allreduce_hook(state, compressed)
        grad.copy_(compressed)
    else:
        out = torch.empty_like(output, dtype=prec)
        reduce_scatter_hook(state, compressed, out)
        output.copy_(out)


def fp16_compress_hook(state: LowPrecisionState, grad: torch.Tensor, output: Optional[torch.Tensor] = None) -> None:
    """Average ``grad`` in float16 (all-reduce, or reduce-scatter into ``output``)."""
    _low_precision_hook(torch.float16, state, grad, output)


def bf16_compress_hook(state: LowPrecisionState, grad: torch.Tensor, output: Optional[torch.Tensor] = None) -> None:
    """Average ``grad`` in bfloat16 (all-reduce, or reduce-scatter into ``output``)."""
    _low_precision_hook(torch.bfloat16, state, grad, output)


def register_comm_hook(module: torch.nn.Module, state: object, hook) -> None:
    """Use ``hook(state, grad[, output])`` for the gradients of the root ``module`` and all of its
    sub-units (once; it cannot be replaced)."""
    unit = unit_of(module)
    if unit is None or not unit.is_root:
        raise AssertionError("register_comm_hook can only be called on a root instance.")
    all_units = units(module)
    for u in all_units:
        if u.comm_hook is not None:
            raise AssertionError("A communication hook is already registered")
        if u.strategy is ShardingStrategy.HYBRID_SHARD:
            raise NotImplementedError("communication hooks are not supported with HYBRID_SHARD")
    for u in all_units:
        u.comm_hook, u.comm_hook_state = hook, state
