"""Megatron-FSDP (0.6.1) on a CPU-only machine with gloo: the shim its adapter installs there.

Megatron-FSDP is CUDA-only as shipped: it asks `torch.cuda` for the current device, streams, events
and synchronisation, allocates its global memory buffer on the GPU, moves a validation tensor there
with `.cuda()`, and gathers uneven DTensor shards with an all-gather of unequal sizes (NCCL allows
it, gloo does not). `install()` changes only what megatron_fsdp's own modules see:

* the name `torch` inside each megatron_fsdp module becomes a view of torch whose `cuda` answers
  device 0, no-op streams / events / synchronisation (CPU work is synchronous);
* its global memory buffer allocates on the CPU;
* `validate_uneven_dtensor` runs with `Tensor.cuda` an identity (only while it runs);
* the name `dist` in `uneven_dtensor` becomes a view of torch.distributed whose `all_gather` pads
  every rank's tensor to the largest size and cuts the results back;
* `gradient_reduce_preprocessing` sees its config with `gradient_reduce_div_fusion` off (the fused
  form is a PREMUL_SUM reduction, NCCL only): gradients are multiplied by 1/dp and then summed, as
  Megatron-FSDP does for bf16 anyway.

The adapter calls `prepare(device)` for every trainer. Nothing here is installed on a machine with
CUDA (`install` refuses, `prepare` skips the cell), and torch itself is never patched beyond the
`Tensor.cuda` window above.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import sys
import types

import pytest
import torch
import torch.distributed as dist


class NoStream:
    """A CUDA stream / event stand-in: on the CPU every operation has completed when it returns."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __getattr__(self, name):  # wait_stream, wait_event, record_event, query, ...: nothing to wait for
        return lambda *args, **kwargs: NoStream()


class CpuCuda(types.ModuleType):
    """`torch.cuda` as megatron_fsdp sees it on the CPU; anything not named here is torch.cuda's."""

    Stream = Event = NoStream

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    current_device = staticmethod(lambda: 0)
    current_stream = staticmethod(lambda *args, **kwargs: NoStream())
    stream = staticmethod(lambda s: contextlib.nullcontext())
    synchronize = staticmethod(lambda *args, **kwargs: None)
    empty_cache = staticmethod(lambda: None)


class Delegate(types.ModuleType):
    """A module that answers every name from `target` except those set on it."""

    def __init__(self, name: str, target) -> None:
        super().__init__(name)
        self.target = target

    def __getattr__(self, name):
        return getattr(self.target, name)


def padded_all_gather(tensor_list, tensor, group=None, async_op=False):
    """`dist.all_gather` for unequal sizes on gloo: every rank sends its tensor zero-padded to the
    largest size of `tensor_list`, and each received tensor is cut back to its own size."""
    size = max(t.numel() for t in tensor_list)
    padded = [t.new_empty(size) for t in tensor_list]
    dist.all_gather(padded, torch.cat([tensor.reshape(-1), tensor.new_zeros(size - tensor.numel())]), group=group)
    for out, got in zip(tensor_list, padded):
        out.copy_(got[: out.numel()].view_as(out))


def cpu_cuda_tensors(fn):
    """`fn` run with `Tensor.cuda` an identity (Megatron moves a validation tensor to the GPU)."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        original, torch.Tensor.cuda = torch.Tensor.cuda, lambda self, *a, **k: self
        try:
            return fn(*args, **kwargs)
        finally:
            torch.Tensor.cuda = original
    return run


def unfused(preprocess):
    """`preprocess(grad, scaling, config)` with `config.gradient_reduce_div_fusion` read as False."""
    @functools.wraps(preprocess)
    def run(grad_data, scaling_factor, ddp_config):
        config = Delegate("ddp_config", ddp_config)
        config.gradient_reduce_div_fusion = False
        return preprocess(grad_data, scaling_factor, config)
    return run


def prepare(device: torch.device) -> None:
    """What a trainer on `device` needs: on CPU tensors the shim, only where CUDA is absent (else the
    cell is skipped: use nccl there); nothing on a GPU."""
    if device.type != "cpu":
        return
    if torch.cuda.is_available():
        pytest.skip("Megatron-FSDP on CPU tensors runs through the CPU shim, only where CUDA is absent: use nccl")
    install()


def install() -> None:
    """Make megatron_fsdp run on the CPU (once per process; never where CUDA is available)."""
    if torch.cuda.is_available():
        raise RuntimeError("the Megatron-FSDP CPU shim is for CPU-only machines")
    from megatron_fsdp import param_and_grad_buffer, uneven_dtensor, utils

    if isinstance(utils.torch, Delegate):
        return
    view = Delegate("torch", torch)
    view.cuda = CpuCuda("torch.cuda")
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron_fsdp") and getattr(module, "torch", None) is torch:
            module.torch = view

    class CpuMemoryBuffer(utils.GlobalMemoryBuffer):
        def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
            numel = functools.reduce(operator.mul, tensor_shape, 1)
            if self.buffer.get((name, dtype)) is None or self.buffer[(name, dtype)].numel() < numel:
                self.buffer[(name, dtype)] = torch.empty(numel, dtype=dtype)
            return self.buffer[(name, dtype)][:numel].view(*tensor_shape)

    utils._GLOBAL_MEMORY_BUFFER = CpuMemoryBuffer()
    param_and_grad_buffer.validate_uneven_dtensor = cpu_cuda_tensors(uneven_dtensor.validate_uneven_dtensor)
    param_and_grad_buffer.gradient_reduce_preprocessing = unfused(param_and_grad_buffer.gradient_reduce_preprocessing)
    uneven_dtensor.dist = Delegate("torch.distributed", dist)
    uneven_dtensor.dist.all_gather = padded_all_gather
