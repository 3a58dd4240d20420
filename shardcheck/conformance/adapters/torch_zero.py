"""torch's ZeRO-1: DistributedDataParallel with `torch.distributed.optim.ZeroRedundancyOptimizer`.

SHARD_OPTIMIZER: DDP replicates the parameters and all-reduces the gradients; the optimizer wraps
the recipe's torch optimizer class, each rank stepping its greedy, size-sorted partition of whole
parameters, then broadcasting them. Variants: `bucket-view` (`parameters_as_bucket_view=True`),
`overlap` (`overlap_with_ddp=True`, the step run from DDP's comm hook) and `grad-bucket-view` (DDP's
`gradient_as_bucket_view=True`: the gradients held once). Checkpoints: the optimizer's
`consolidate_state_dict` on the group's first rank, which writes one file; every rank loads it and
ZeroRedundancyOptimizer keeps its own partition (at any world size).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer

from shardcheck.strategy import Strategy
from shardcheck.conformance.adapters.ddp import DDPAdapter
from shardcheck.conformance.protocol import Unsupported

FILE = "zero.pt"


class TorchZeroAdapter(DDPAdapter):
    name = "torch-zero"
    strategy = Strategy.SHARD_OPTIMIZER
    capabilities = (DDPAdapter.capabilities - {"no_shard"}) | {"shard_optimizer"}
    variants = {"bucket-view": "parameters_as_bucket_view=True: parameters packed into one bucket per device "
                               "and dtype, param.data views into it",
                "overlap": "overlap_with_ddp=True: the optimizer step overlapped with DDP's gradient buckets "
                           "(ddp_zero_hook.hook_with_zero_step)",
                "grad-bucket-view": "DDP(gradient_as_bucket_view=True): .grad views into DDP's buckets, the "
                                    "gradients held once (DDP's documented memory saving; F43 without it)"}

    def __init__(self, variant: str | None = None) -> None:
        self.variant = variant
        self.name = f"torch-zero[{variant}]" if variant else "torch-zero"

    def shard(self, model, spec, find_unused_parameters: bool = False):
        if self.variant == "overlap" and dist.get_backend() not in ("nccl", "hccl"):
            raise Unsupported("overlap_with_ddp: torch's hook_with_zero_step raises on any backend other than "
                              "NCCL/HCCL (ddp_zero_hook.py: 'Gloo may hang')")
        return super().shard(model, spec, find_unused_parameters, gradient_as_bucket_view=self.variant == "grad-bucket-view")

    def optimizer(self, model, spec, recipe):
        zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=recipe.optimizer.torch_class,
                                       process_group=model.process_group,
                                       parameters_as_bucket_view=self.variant == "bucket-view",
                                       overlap_with_ddp=self.variant == "overlap", **recipe.optimizer.torch_kwargs())
        if self.variant == "overlap":
            from torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook import hook_with_zero_step
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            model.register_comm_hook(None, hook_with_zero_step(allreduce_hook, model, zero))
        return zero

    def save_checkpoint(self, model, optimizer, scaler, path):
        group = model.process_group
        first = dist.get_global_rank(group, 0)
        optimizer.consolidate_state_dict(to=first)
        if dist.get_rank() == first:
            Path(path).mkdir(parents=True, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scaler": None if scaler is None else scaler.state_dict()}, Path(path) / FILE)
        dist.barrier(group=group)

    def load_checkpoint(self, model, optimizer, scaler, path):
        state = torch.load(Path(path) / FILE, map_location=next(model.parameters()).device, weights_only=True)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        if scaler is not None:
            scaler.load_state_dict(state["scaler"])

    def full_optimizer_state(self, model, optimizer):
        """Consolidated on each rank in turn (consolidate_state_dict reaches one rank at a time)."""
        group = model.process_group
        mine = None
        for r in range(dist.get_world_size(group)):
            optimizer.consolidate_state_dict(to=dist.get_global_rank(group, r))
            if dist.get_rank(group) == r:
                mine = optimizer.state_dict()
        names = [n.removeprefix("module.") for n, _ in model.named_parameters()]
        return {names[i]: dict(entry) for i, entry in mine["state"].items()}
