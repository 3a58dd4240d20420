"""Megatron-FSDP (NVIDIA's standalone `megatron-fsdp`) behind the behaviour protocol (optional: README).

`fully_shard(module, optimizer, ...)` wraps the model and the recipe's torch optimizer; parameters and
gradients become DTensors cut unevenly from its flat buffers. It averages gradients itself and has no
clip of its own: the trainer clips with torch's, as its users do. No loss scaling or mixed precision
declared. CPU tensors go through the shim `megatron_cpu`. Checkpoints: DCP over its DCP-ready state
dicts (`preproc_state_dict_for_dcp_ckpt=True`). Semantics and findings: FINDINGS.md.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from shardcheck.strategy import Strategy
from shardcheck.conformance.protocol import StepResult, Unsupported

try:
    from megatron_fsdp import fully_shard
    from megatron_fsdp.uneven_dtensor import uneven_dtensor_to_full_tensor
except ImportError as exc:  # an optional engine: `--impl all` leaves it out with this reason
    raise ImportError(f"megatron-fsdp is not importable ({exc}): see the README (torch pinned first, then "
                      "pip install 'shardcheck[megatron]')") from None
from shardcheck.conformance.adapters import megatron_cpu

STRATEGIES = {Strategy.FULL_SHARD: "optim_grads_params", Strategy.SHARD_GRAD_OP: "optim_grads", Strategy.NO_SHARD: "no_shard",
              Strategy.HYBRID_SHARD: "optim_grads_params"}


@functools.cache  # one set of process groups per test mesh (the harness caches those), not per trainer
def megatron_mesh(mesh: DeviceMesh) -> tuple[DeviceMesh, dict]:
    """The ((outer,) fsdp, tp=1) mesh Megatron-FSDP asks for and the fully_shard arguments naming it."""
    if mesh.ndim == 2 and mesh.size() != dist.get_world_size():
        raise Unsupported("Megatron-FSDP HSDP needs the flattened group of the whole mesh: only the world here")
    names = ("outer", "fsdp", "tp")[-mesh.ndim - 1:]
    megatron = DeviceMesh(mesh.device_type, mesh.mesh.reshape(*mesh.mesh.shape, 1), mesh_dim_names=names)
    return megatron, {"dp_outer_dim": "outer", "hybrid_fsdp_group": dist.group.WORLD} if mesh.ndim == 2 else {}


def full(value: DTensor) -> torch.Tensor:
    """The full value of a parameter or gradient DTensor. Collective."""
    return uneven_dtensor_to_full_tensor(value.detach()).float().clone()


class MegatronFSDPTrainer:
    def __init__(self, model, spec, recipe):
        mesh, hybrid = megatron_mesh(spec.mesh)
        units = list(dict.fromkeys(type(m) for _, m in spec.unit_modules(model))) or None
        self.recipe = recipe
        self.model, self.optimizer = fully_shard(
            model, recipe.optimizer.build(model.parameters()), device_mesh=mesh, dp_shard_dim="fsdp", tp_dim="tp",
            zero_dp_strategy=STRATEGIES[spec.strategy], fsdp_unit_modules=units, device=spec.device,
            preproc_state_dict_for_dcp_ckpt=True, **hybrid)
        self.optimizer.state.clear()  # fully_shard's zero-gradient warm-up step (FINDINGS F19)
        self.params = [(n.removeprefix("module."), p) for n, p in self.model.named_parameters()]  # its .module

    def forward_backward(self, batch):
        loss = self.recipe.loss_fn(self.model, batch)
        loss.backward()
        return loss.detach()

    def full_grads(self):
        held = torch.tensor([p.grad is not None for _, p in self.params], dtype=torch.int32)
        dist.all_reduce(held, op=dist.ReduceOp.MAX)  # None only where no rank holds a gradient
        # p.grad is None where the rank's slice is empty: the parameter, an empty slice too, stands in
        return {n: full(p if p.grad is None else p.grad) if h else None
                for (n, p), h in zip(self.params, held.tolist())}

    def step(self):
        clip, total = self.recipe.clip, None
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_([p for _, p in self.params], clip.max_norm, clip.norm_type)
            total = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        self.optimizer.step()
        self.optimizer.zero_grad()
        return StepResult(total_norm=total)

    def full_params(self):
        return {n: full(p) for n, p in self.params}

    # Capability `checkpoint`: torch DCP over the wrapped model's and optimizer's state dicts, which
    # fully_shard(preproc_state_dict_for_dcp_ckpt=True) makes DCP-ready (uneven DTensors).
    def _state(self):
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def save(self, path):
        torch.distributed.checkpoint.save(self._state(), checkpoint_id=str(path))

    def load(self, path):
        """DCP fills only the keys the template holds: the optimizer's state is built first (torch's
        lazy init, lr 0), as fully_shard's own warm-up step would have, which this trainer undoes (F19)."""
        from torch.distributed.checkpoint.state_dict import _init_optim_state

        _init_optim_state(self.optimizer)
        state = self._state()
        torch.distributed.checkpoint.load(state, checkpoint_id=str(path))
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    def full_state_dict(self):
        values = self.full_params()
        named = {n.removeprefix("module."): t for n, t in self.model.state_dict().items()}
        return {n: values.get(n, t).detach().clone() for n, t in named.items()}

    def full_optimizer_state(self):
        """By position: the optimizer's parameters are the module's, in the order it was built with (a
        load re-installs the module's parameters, so identities do not survive it)."""
        held = [p for group in self.optimizer.param_groups for p in group["params"]]
        return {n: {k: full(v) if isinstance(v, DTensor) and v.dim() > 0 else
                    (v.to_local() if isinstance(v, DTensor) else v) for k, v in self.optimizer.state.get(p, {}).items()}
                for (n, _), p in zip(self.params, held)}


class MegatronFSDPAdapter:
    name = "megatron-fsdp"
    version = importlib.metadata.version("megatron-fsdp")
    capabilities = frozenset({"full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "clip_norm_1",
                              "clip_norm_2", "clip_norm_inf", "activation_checkpointing", "buffers", "compile",
                              "checkpoint"})

    def trainer(self, model, spec, recipe):
        if "LOCAL_RANK" not in os.environ:  # thread ranks would share its process-global buffers
            pytest.skip("Megatron-FSDP keeps process-global buffers: one process per rank (not thread mode)")
        if len(spec.strategies) > 1 or spec.offload or spec.mixed_precision is not None:
            raise Unsupported("Megatron-FSDP here: one strategy per model, no offload, the module's own dtype")
        megatron_cpu.prepare(spec.device)  # CPU tensors: the shim, on a CPU-only machine (else a skip)
        return MegatronFSDPTrainer(model, spec, recipe)
