"""Megatron-FSDP (NVIDIA's standalone `megatron-fsdp`) behind the behaviour protocol (optional: README).

`fully_shard(module, optimizer, ...)` wraps the model and the recipe's torch optimizer; parameters
and gradients become unevenly sharded DTensors cut from its flat buffers (a rank whose slice of a
parameter is empty has `p.grad` None), and `optimizer.step()` / `zero_grad()` drive its buffers.
Strategies map to its ZeRO-like `zero_dp_strategy`: FULL_SHARD -> optim_grads_params (units: the
spec's unit classes), SHARD_GRAD_OP -> optim_grads, NO_SHARD -> no_shard, HYBRID_SHARD ->
optim_grads_params within the mesh's shard groups and no_shard across them (HSDP). It averages
gradients itself (x 1/dp, then sum). It has no clipping of its own: its users clip its DTensor
gradients with `torch.nn.utils.clip_grad_norm_`, and so does the trainer. No loss scaling, no mixed
precision declared (its compute dtype is the module's own). On a CPU-only machine the adapter installs
`megatron_cpu` (a documented shim, never on a GPU) and the full values are read with its
`uneven_dtensor_to_full_tensor`. Process backends only: its global memory buffer is per process.
"""

from __future__ import annotations

import importlib.metadata
import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from conformance.protocol import StepResult, Unsupported

try:
    from megatron_fsdp import fully_shard
    from megatron_fsdp.uneven_dtensor import uneven_dtensor_to_full_tensor
except ImportError as exc:  # an optional engine: `--impl all` leaves it out with this reason
    raise ImportError(f"megatron-fsdp is not importable ({exc}): see the README (torch pinned first, then "
                      "pip install -e '.[megatron]')") from None
from conformance.adapters import megatron_cpu

STRATEGIES = {"FULL_SHARD": "optim_grads_params", "SHARD_GRAD_OP": "optim_grads", "NO_SHARD": "no_shard",
              "HYBRID_SHARD": "optim_grads_params"}
PREFIX = "module."  # MegatronFSDP holds the original model as .module


def megatron_mesh(mesh: DeviceMesh) -> tuple[DeviceMesh, dict]:
    """The (outer?, fsdp, tp=1) mesh Megatron-FSDP asks for, and the fully_shard arguments naming it."""
    if mesh.ndim == 1:
        return DeviceMesh(mesh.device_type, mesh.mesh.reshape(-1, 1), mesh_dim_names=("fsdp", "tp")), {}
    if mesh.size() != dist.get_world_size():
        raise Unsupported("Megatron-FSDP HSDP needs the flattened group of the whole mesh: only the world here")
    hybrid = DeviceMesh(mesh.device_type, mesh.mesh.reshape(*mesh.mesh.shape, 1), mesh_dim_names=("outer", "fsdp", "tp"))
    return hybrid, {"dp_outer_dim": "outer", "hybrid_fsdp_group": dist.group.WORLD}


def full(param: DTensor, value: torch.Tensor | None) -> torch.Tensor:
    """The full value of `value` (the parameter or its gradient; None on a rank whose slice is empty,
    where a zero-size stand-in takes part in the collective). Collective."""
    if value is None:
        local = param.to_local()
        value = DTensor.from_local(local.new_zeros(local.shape), param.device_mesh, param.placements,
                                   run_check=False, shape=param.shape, stride=param.stride())
    return uneven_dtensor_to_full_tensor(value.detach()).float().clone()


class MegatronFSDPTrainer:
    def __init__(self, adapter, model, spec, recipe):
        if spec.device.type == "cpu":  # CPU tensors: only on a CPU-only machine, through the shim
            megatron_cpu.install()
        mesh, hybrid = adapter.mesh(spec.mesh)
        units = list(dict.fromkeys(type(m) for _, m in spec.unit_modules(model))) or None
        self.recipe = recipe
        self.model, self.optimizer = fully_shard(
            model, recipe.optimizer.build(model.parameters()), device_mesh=mesh, dp_shard_dim="fsdp", tp_dim="tp",
            zero_dp_strategy=STRATEGIES[spec.strategy], fsdp_unit_modules=units, device=spec.device,
            preproc_state_dict_for_dcp_ckpt=False, **hybrid)
        self.model.ddp_config.gradient_reduce_div_fusion = False  # a PREMUL_SUM reduction: NCCL only
        self.optimizer.state.clear()  # fully_shard's zero-gradient warm-up step (FINDINGS F19)
        self.params = [(n.removeprefix(PREFIX), p) for n, p in self.model.named_parameters()]

    def forward_backward(self, batch):
        loss = self.recipe.loss_fn(self.model, batch)
        loss.backward()
        return loss.detach()

    def full_grads(self):
        held = torch.tensor([p.grad is not None for _, p in self.params], dtype=torch.int32)
        dist.all_reduce(held, op=dist.ReduceOp.MAX)  # None only where no rank holds a gradient
        return {n: full(p, p.grad) if h else None for (n, p), h in zip(self.params, held.tolist())}

    def step(self):
        clip, total = self.recipe.clip, None
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_([p for _, p in self.params], clip.max_norm, clip.norm_type)
            total = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        self.optimizer.step()
        self.optimizer.zero_grad()
        return StepResult(total_norm=total)

    def full_params(self):
        return {n: full(p, p) for n, p in self.params}


class MegatronFSDPAdapter:
    name = "megatron-fsdp"
    version = importlib.metadata.version("megatron-fsdp")
    capabilities = frozenset({"full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "clip_norm_1",
                              "clip_norm_2", "clip_norm_inf"})

    def __init__(self):
        self.meshes = {}

    def mesh(self, mesh):
        if id(mesh) not in self.meshes:  # one set of process groups per test mesh, not per trainer
            self.meshes[id(mesh)] = megatron_mesh(mesh)
        return self.meshes[id(mesh)]

    def trainer(self, model, spec, recipe):
        if "LOCAL_RANK" not in os.environ:  # thread ranks would share its process-global buffers
            pytest.skip("Megatron-FSDP keeps process-global buffers: one process per rank (not thread mode)")
        if spec.device.type == "cpu" and torch.cuda.is_available():
            pytest.skip("Megatron-FSDP on CPU tensors runs through the CPU shim, only where CUDA is absent: use nccl")
        if len(spec.strategies) > 1 or spec.offload or spec.mixed_precision is not None:
            raise Unsupported("Megatron-FSDP here: one strategy per model, no offload, the module's own dtype")
        return MegatronFSDPTrainer(self, model, spec, recipe)
