"""What the front-end adapters (accelerate.py, lightning.py) share: reading the torch FSDP module a
front-end built, and the process-level conditions both need.

Accelerate and Lightning wrap a model in torch's FSDP1 (`FullyShardedDataParallel`) or FSDP2
(`fully_shard`, DTensor parameters). Neither exposes full gradients, so `full_grads` reads them as the
torch adapters do: `summon_full_params(with_grads=True)` (FSDP1) or one all-gather per shard group
(FSDP2, dtensors.full_tensors). A front-end's own full state dict is kept on rank 0 only
(`rank0_only=True`): `from_rank0` hands rank 0's copy to every rank.

A spec's units (`spec.unit_modules(model)`) reach the front-end through its wrap policy: `wrap_policy`
for FSDP1's `auto_wrap_policy` (both front-ends pass it to `FullyShardedDataParallel`), `unit_class_names`
where a front-end takes layer classes by name only (Accelerate's FSDP2).
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

from shardcheck.conformance.adapters.dtensors import full_tensors
from shardcheck.conformance.adapters.torch_fsdp1 import TorchFSDP1Adapter
from shardcheck.conformance.protocol import Unsupported

def require_processes(frontend: str, spec) -> None:
    """Skip in thread mode: both front-ends keep process-global state (singletons, the environment).
    Unsupported off the CPU: the adapters build the CPU setups (and their shims) only."""
    if "LOCAL_RANK" not in os.environ:
        pytest.skip(f"{frontend} keeps process-global state: one process per rank (not thread mode)")
    if spec.device.type != "cpu":
        raise Unsupported(f"the {frontend} adapter builds its CPU/gloo setup only (accelerator='cpu', the CPU shims)")


def wrap_policy(spec, model):
    """FSDP1's `auto_wrap_policy` that makes exactly `spec.unit_modules(model)` units (torch's
    `lambda_auto_wrap_policy`: wrap a module iff `lambda_fn(module)`; modules compare by identity); None
    without units (the root alone, FSDP's default)."""
    units = {module for _, module in spec.unit_modules(model)}
    return functools.partial(lambda_auto_wrap_policy, lambda_fn=units.__contains__) if units else None


def unit_class_names(spec, model, who: str) -> list[str]:
    """The class names whose instances below the root are exactly `spec.unit_modules(model)`, for a
    front-end that wraps by layer class name (a name resolves to the first class of that name in the
    model; a module is wrapped if it is an instance of it). Unsupported where no set of classes picks
    out just the units (e.g. one Linear of several)."""
    units = {module for _, module in spec.unit_modules(model)}
    classes = {type(module) for module in units}
    names = sorted({cls.__name__ for cls in classes})
    picked = {m for path, m in model.named_modules() if path and isinstance(m, tuple(classes))}
    named = {type(m) for m in model.modules() if type(m).__name__ in names}
    if picked != units or named != classes:
        raise Unsupported(f"{who} wraps by layer class name: the classes {', '.join(names)} name other modules "
                          f"than the units {', '.join(p for p, _ in spec.unit_modules(model))}")
    return names


def from_rank0(state: dict) -> dict:
    """Rank 0's copy of a front-end's full state dict (kept on rank 0 alone), on every rank. Collective."""
    import torch.distributed as dist

    held = [state if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(held, src=0)
    return {n: t.detach().clone() for n, t in held[0].items()}


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
