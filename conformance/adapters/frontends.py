"""What the front-end adapters (accelerate.py, lightning.py) share: reading the torch FSDP module a
front-end built, and the process-level conditions both need.

Accelerate and Lightning wrap a model in torch's FSDP1 (`FullyShardedDataParallel`) or FSDP2
(`fully_shard`, DTensor parameters). Neither exposes full gradients, so `full_grads` reads them as the
torch adapters do: `summon_full_params(with_grads=True)` (FSDP1) or one all-gather per shard group
(FSDP2, dtensors.full_tensors). A front-end's own full state dict is kept on rank 0 only
(`rank0_only=True`): `from_rank0` hands rank 0's copy to every rank.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from conformance.adapters.dtensors import full_tensors
from conformance.adapters.torch_fsdp1 import TorchFSDP1Adapter
from conformance.protocol import Unsupported

STRATEGIES_FSDP2 = {"FULL_SHARD": True, "SHARD_GRAD_OP": False}  # reshard_after_forward


def require_processes(frontend: str, spec) -> None:
    """Skip in thread mode: both front-ends keep process-global state (singletons, the environment).
    Unsupported off the CPU: the adapters build the CPU setups (and their shims) only."""
    if "LOCAL_RANK" not in os.environ:
        pytest.skip(f"{frontend} keeps process-global state: one process per rank (not thread mode)")
    if spec.device.type != "cpu":
        raise Unsupported(f"the {frontend} adapter builds its CPU/gloo setup only (accelerator='cpu', the CPU shims)")


def is_fsdp1(module: torch.nn.Module) -> bool:
    return any(isinstance(m, FSDP) for m in module.modules())


def full_grads(module: torch.nn.Module) -> dict:
    """{name: full averaged gradient or None} of the torch FSDP module under a front-end. Collective."""
    if is_fsdp1(module):
        return TorchFSDP1Adapter().full_grads(module)
    return {n: None if g is None else g.float() for n, g in
            full_tensors({n: p.grad for n, p in module.named_parameters()}).items()}


def full_params(module: torch.nn.Module) -> dict:
    """{name: full float32 parameter} of the torch FSDP module under a front-end. Collective."""
    if is_fsdp1(module):
        return {n: p.float() for n, p in TorchFSDP1Adapter().full_params(module).items()}
    return {n: p.float() for n, p in full_tensors({n: p.detach() for n, p in module.named_parameters()}).items()}
