"""Mutants that train exactly right and waste what sharding is for: the liars the family sharding
(conformance/checks/behaviour/test_sharding.py) must catch from measured memory and traffic alone.
Each passes every numeric check: their gradients, norms and parameters are those of the reference."""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist

from conformance.mutants.base import MutantAdapter, replace
from conformance.protocol.torch_style import TorchStyleTrainer

SHARDING_CHECKS = ("test_sharding.py::test_sharding", "test_sharding.py::test_sharding_hybrid")


def _sharding():
    return importlib.import_module("reference_impl.sharding")


class ReplicatesDeclaresFullShard(MutantAdapter):
    """Every unit is built NO_SHARD whatever the strategy asked (over the whole world): whole
    parameters, gradients and optimizer state on every rank, gradients all-reduced. It trains
    exactly like unsharded data parallelism, as an adapter that wraps DDP and declares FULL_SHARD."""

    name = "mutant-replicates-declares-full-shard"
    bug = "replicates every parameter while declaring FULL_SHARD (SHARD_GRAD_OP, HYBRID_SHARD)"
    checks = SHARDING_CHECKS
    world_sizes = (2, 4)

    def patch(self) -> None:
        ri = importlib.import_module("reference_impl")
        original = ri.shard

        def replicating(module, *, mesh=None, process_group=None, strategy=None, **kwargs):
            flat = mesh if mesh is None or mesh.ndim == 1 else None  # a 2-D mesh: the whole world
            return original(module, mesh=flat, process_group=process_group,
                            strategy=ri.ShardingStrategy.NO_SHARD, **kwargs)

        replace(ri, "shard", replicating)


class NoReshardAfterForward(MutantAdapter):
    """FULL_SHARD (and HYBRID_SHARD) keep every unit's gathered parameters from forward to backward,
    as SHARD_GRAD_OP does: one all-gather per step saved, the whole model held at its peak."""

    name = "mutant-no-reshard-after-forward"
    bug = "FULL_SHARD never reshards after forward (gathered parameters kept until backward)"
    checks = SHARDING_CHECKS
    world_sizes = (2, 4)

    def patch(self) -> None:
        S = _sharding()
        replace(S.Unit, "frees_after_forward", property(lambda unit: False))


class _FullStateTrainer(TorchStyleTrainer):
    """The reference's step with the optimizer's moments allocated for the whole (unsharded)
    parameter on every rank, of which each rank updates its shard's first elements only."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.optimizer.register_step_pre_hook(self._allocate_full_state)

    def _allocate_full_state(self, optimizer, *_):
        world = dist.get_world_size()
        for group in optimizer.param_groups:
            for p in group["params"]:
                state = optimizer.state[p]
                if state or p.grad is None or group.get("betas") is None:
                    continue
                state["step"] = torch.tensor(0.0)
                for key in ("exp_avg", "exp_avg_sq"):
                    full = torch.zeros(p.numel() * world, dtype=p.dtype, device=p.device)
                    state[key] = full[: p.numel()].view_as(p)


class UnshardedOptimizerState(MutantAdapter):
    """Adam's moments allocated at the full parameter size on every rank (an optimizer built over
    the unsharded flat buffer, each rank stepping its own slice): parameters and gradients sharded,
    optimizer state not."""

    name = "mutant-unsharded-optimizer-state"
    bug = "optimizer state kept at full size on every rank (parameters and gradients sharded)"
    checks = SHARDING_CHECKS
    world_sizes = (2, 4)

    def patch(self) -> None:
        pass  # the trainer is the mutant: nothing of reference_impl changes

    def trainer(self, model, spec, recipe):
        return _FullStateTrainer(self, model, spec, recipe)
