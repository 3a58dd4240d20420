"""shardcheck's own reference implementation (reference_impl) behind the adapter protocol."""

from __future__ import annotations

import torch

import shardcheck.reference_impl as ri
from shardcheck.strategy import Strategy
from shardcheck.reference_impl import checkpoint, loading
from shardcheck.conformance.protocol import ShardSpec, TorchStyleAdapter, materialize, on_meta

STRATEGIES = {s.value: s for s in ri.ShardingStrategy}  # Strategy -> the reference's unit mode
STRATEGIES[Strategy.SHARD_OPTIMIZER] = ri.ShardingStrategy.NO_SHARD  # units replicate; ShardedOptimizer shards the state


class ReferenceAdapter(TorchStyleAdapter):
    name = "reference"
    version = "0.1.0"
    capabilities = TorchStyleAdapter.implied({
        "full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "shard_optimizer", "mixed_strategy", "nested_units", "orig_params",
        "mixed_precision", "keep_low_precision_grads", "per_unit_mixed_precision", "buffer_dtype", "cpu_offload", "clip_grad_norm",
        "sharded_grad_scaler", "comm_hooks", "compression_hooks", "all_gather_extensions",
        "meta_init", "checkpoint", "checkpoint_reshard", "grad_accumulation", "no_sync", "eval_forward", "unused_params", "requires_grad_changes",
        "activation_checkpointing", "buffers", "compile", "tensor_parallel", "gradient_divide_factor",
        "token_weighted_loss", "reshard_after_backward", "is_last_backward", "meta_load", "idle_experts", "expert_mesh",
    })

    def shard(self, model, spec: ShardSpec):
        if spec.tensor_parallel:
            ri.parallelize(model, spec.mesh["tp"].get_group(), spec.tensor_parallel)

        def one(module, path):
            if path in spec.unit_meshes:  # a mesh of its own: shard over its second dimension, replicate over its first
                return ri.shard(module, mesh=spec.unit_meshes[path], strategy=ri.ShardingStrategy.HYBRID_SHARD,
                                mixed_precision=spec.mixed_precision_of(path), offload=spec.offload,
                                gradient_divide_factor=spec.gradient_divide_factor)
            ri.shard(module, mesh=spec.dp_mesh, strategy=STRATEGIES[spec.strategy_of(path)],
                     mixed_precision=spec.mixed_precision_of(path), offload=spec.offload,
                     gradient_divide_factor=spec.gradient_divide_factor)

        for path, module in spec.unit_modules(model):
            one(module, path)
        one(model, "")
        return model

    def prepare(self, model, spec: ShardSpec, recipe):
        """Shard; with experts some ranks route no token to (`recipe.routed`) every unit agrees which
        parameters some rank has a gradient for, as DDP's find_unused_parameters does (routed.py)."""
        self.shard(model, spec)
        if recipe.routed:
            ri.set_reduce_unused(model, True)
        return model

    def shard_from_rank0(self, model, spec: ShardSpec):
        """Rank 0 keeps a copy of what its model holds; every rank shards, the skeletons get storage
        (`to_empty`), and `loading.fill_from_rank0` broadcasts rank 0's parameters and buffers."""
        values = None if on_meta(model) else loading.held(model)
        self.shard(model, spec)
        if values is None:
            materialize(model, spec.device)
        loading.fill_from_rank0(model, values)
        return model

    def optimizer(self, model, spec: ShardSpec, recipe):
        if spec.strategy != Strategy.SHARD_OPTIMIZER:
            return recipe.optimizer.build(model.parameters())
        group = spec.dp_mesh.get_group() if spec.dp_mesh is not None else torch.distributed.group.WORLD
        return ri.ShardedOptimizer(model.parameters(), recipe.optimizer.build, group)

    def no_sync(self, model):
        return ri.no_sync(model)

    def set_reshard_after_backward(self, model, flag):
        ri.set_reshard_after_backward(model, flag)

    def set_is_last_backward(self, model, flag):
        """reference_impl's reductions are synchronous: no backward leaves work pending for the last
        one to wait on (FSDP2's finalize_backward), so the mark changes nothing."""

    def held_grads(self, model):
        return [g for u in ri.units(model) for g in (u.unsynced or []) if g is not None]

    def full_params(self, model):
        return ri.full_state(model)

    def full_grads(self, model):
        return ri.full_grads(model)

    def clip_grad_norm_(self, model, max_norm, norm_type):
        return ri.clip_grad_norm_(model, max_norm, norm_type)

    def clip_grad_norm_unit_(self, model, path, max_norm):
        return ri.clip_grad_norm_(model.get_submodule(path), max_norm)

    def grad_scaler(self, **kwargs):
        return ri.ShardedGradScaler(**kwargs)

    def register_comm_hook(self, model, state, hook, path=""):
        ri.register_comm_hook(model.get_submodule(path) if path else model, state, hook)

    def comm_hooks(self, model):
        return [(u.comm_hook, u.comm_hook_state) for u in ri.units(model)]

    def compression_hook(self, dtype):
        import torch.distributed as dist

        hook = {torch.float16: ri.fp16_compress_hook, torch.bfloat16: ri.bf16_compress_hook}[dtype]
        return ri.LowPrecisionState(dist.group.WORLD), hook

    def local_shards(self, model):
        return {name: ri.local_shard(p) for name, p in model.named_parameters()}

    def save_checkpoint(self, model, optimizer, scaler, path):
        checkpoint.save(path, model, optimizer, scaler)

    def load_checkpoint(self, model, optimizer, scaler, path):
        checkpoint.load(path, model, optimizer, scaler)

    def full_state_dict(self, model):
        return checkpoint.full_state_dict(model)

    def full_optimizer_state(self, model, optimizer):
        return checkpoint.full_optimizer_state(model, optimizer)
