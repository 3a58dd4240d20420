"""torch DistributedDataParallel: the unsharded baseline behind the adapter protocol.

Every strategy is NO_SHARD in effect, so only "no_shard" is declared; parameters and (already
all-reduced, averaged) gradients are whole on every rank. Mixed precision is DDP's own (private,
experimental) `_MixedPrecision`; on CPU its forward needs device events (FINDINGS F16).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.parallel.distributed import _MixedPrecision

from shardcheck.strategy import Strategy
from shardcheck.conformance.adapters import dcp
from shardcheck.conformance.protocol import ShardSpec, TorchStyleAdapter, Unsupported

_PREFIX = "module."


class DDPAdapter(dcp.DCPCheckpoints, TorchStyleAdapter):
    name = "ddp"
    version = torch.__version__
    strategy = Strategy.NO_SHARD  # the one strategy it answers (torch-zero: SHARD_OPTIMIZER)
    capabilities = TorchStyleAdapter.implied({"checkpoint", "checkpoint_reshard", "no_shard", "orig_params", "clip_grad_norm", "sharded_grad_scaler"}) | {
        "mixed_precision_bf16", "mixed_precision_fp16", "grad_accumulation", "no_sync", "eval_forward", "unused_params", "requires_grad_changes",
        "activation_checkpointing", "buffers", "compile", "token_weighted_loss", "idle_experts"}

    def prepare(self, model: nn.Module, spec: ShardSpec, recipe) -> nn.Module:
        """DDP needs to be told of parameters that get no gradient (`find_unused_parameters`), as its
        documentation prescribes for a model whose parameters are unused or frozen in some iteration
        (https://docs.pytorch.org/docs/stable/generated/torch.nn.parallel.DistributedDataParallel.html:
        the argument's description, and the "Expected to have finished reduction in the prior
        iteration" error, which names it): a model with unused parameters, frozen ones, or a
        schedule that changes requires_grad (FINDINGS F54: with it, a layer frozen after wrapping is
        averaged; a layer unfrozen after wrapping still is not, as DDP documents), or experts that
        some ranks route no token to (`recipe.routed`)."""
        changes = bool(recipe.unused or recipe.frozen or recipe.requires_grad_at or recipe.routed)
        return self.shard(model, spec, find_unused_parameters=changes)

    def no_sync(self, model):
        return model.no_sync()

    def shard(self, model: nn.Module, spec: ShardSpec, find_unused_parameters: bool = False,
              gradient_as_bucket_view: bool = False):
        mp = spec.mixed_precision
        if spec.strategies != {self.strategy} or spec.offload or (mp and (mp.buffer_dtype or mp.keep_low_precision_grads)):
            raise Unsupported(f"DDP only replicates ({self.strategy}; no offload, buffer dtype or low-precision grads)")
        kwargs = {"mixed_precision": _MixedPrecision(mp.param_dtype, mp.reduce_dtype or mp.param_dtype)} if mp else {}
        group = spec.mesh.get_group() if spec.mesh is not None else None
        device_ids = [spec.device] if spec.device.type == "cuda" else None
        return DDP(model, device_ids=device_ids, process_group=group,
                   find_unused_parameters=find_unused_parameters, gradient_as_bucket_view=gradient_as_bucket_view,
                   **kwargs)

    def full_params(self, model):
        return {n.removeprefix(_PREFIX): p.detach().clone() for n, p in model.named_parameters()}

    def full_grads(self, model):
        return {n.removeprefix(_PREFIX): None if p.grad is None else p.grad.detach().clone()
                for n, p in model.named_parameters()}

    def clip_grad_norm_(self, model, max_norm, norm_type):
        # Gradients are already all-reduced: the local norm is the global one.
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)

    def clip_grad_norm_unit_(self, model, path, max_norm):
        raise Unsupported("DDP has no units")

    def grad_scaler(self, device, process_group=None, **kwargs):
        # Gradients are identical on every rank after DDP's all-reduce, so a plain GradScaler's
        # found_inf is already agreed across ranks.
        return torch.amp.GradScaler(device, **kwargs)

    def register_comm_hook(self, model, state, hook, path=""):
        raise Unsupported("DDP comm hooks have a different (bucket) signature")

    def comm_hooks(self, model):
        raise Unsupported("DDP comm hooks are not introspectable per unit")

    def compression_hook(self, dtype):
        raise Unsupported("DDP compression hooks have the bucket signature")

    def local_shards(self, model):
        raise Unsupported("DDP does not all-gather parameters")
