"""torch FSDP1 (`FullyShardedDataParallel`) behind the adapter protocol.

Units are wrapped bottom-up by hand (FSDP(unit) for each of `spec.unit_modules`, then the root), so
per-unit strategies (mixed_strategy) work. On CPU every instance gets `device_id=cpu` (FINDINGS F6)
and HYBRID strategies need the spec's explicit 2-D mesh. Nothing in torch is patched here: CPU
failures (CPUOffload pinning F2, compression hooks' record_stream F8) are findings.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffload, FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision as FSDPMixedPrecision, ShardingStrategy

from shardcheck.strategy import Strategy
from shardcheck.conformance.adapters import dcp

from shardcheck.conformance.protocol import ShardSpec, TorchStyleAdapter, Unsupported

_PREFIX = "_fsdp_wrapped_module."


def _clean(name: str) -> str:
    return name.replace(_PREFIX, "")


def _unit(model, path):
    return next(m for n, m in model.named_modules() if isinstance(m, FSDP) and _clean(n).rstrip(".") == path)


def _flat_grads(model):
    """use_orig_params=False: all-gather each unit's flat gradient and cut it into parameters."""
    out = {}
    for prefix, m in ((_clean(n), m) for n, m in model.named_modules() if isinstance(m, FSDP)):
        fp = m._handle.flat_param if m._handle else None
        if fp is None:
            continue
        full = fp.grad
        if full is not None and m._handle.uses_sharded_strategy:
            full = fp.grad.new_empty(fp.grad.numel() * dist.get_world_size(m.process_group))
            dist.all_gather_into_tensor(full, fp.grad.contiguous(), group=m.process_group)
        chunks = iter([None] * len(fp._fqns) if full is None else
                      full[:sum(fp._numels_with_padding)].split(list(fp._numels_with_padding)))
        real = (c for c, pad in zip(chunks, fp._is_padding_mask) if not pad) if full is not None else chunks
        for fqn, shape, chunk in zip(fp._fqns, fp._shapes, real):
            out[(prefix + "." if prefix else "") + fqn] = None if chunk is None else chunk.view(shape).clone()
    return out


ON_THREADS = ("FSDP1 cannot run with ranks as threads of one process: its state dicts (the model's, the optimizer's) time "
              "themselves in process-global state (SimpleProfiler) that the rank threads share and trip over, and its sharded "
              "ones build ShardedTensors, which ask the group for a device (torch's threaded group registers none) and take "
              "CUDA for any backend but gloo; on gloo it runs")


def _set(parent, path, module):
    *head, last = path.split(".")
    setattr(parent.get_submodule(".".join(head)) if head else parent, last, module)


class TorchFSDP1Adapter(dcp.DCPCheckpoints, TorchStyleAdapter):
    version = torch.__version__
    capabilities = TorchStyleAdapter.implied({
        "full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "mixed_strategy", "nested_units",
        "mixed_precision", "keep_low_precision_grads", "per_unit_mixed_precision", "buffer_dtype", "cpu_offload",
        "clip_grad_norm", "sharded_grad_scaler", "comm_hooks", "compression_hooks",
        "grad_accumulation", "no_sync", "eval_forward", "unused_params", "requires_grad_changes", "meta_init", "checkpoint", "checkpoint_reshard", "activation_checkpointing", "buffers", "compile", "idle_experts",
        "token_weighted_loss", "reshard_after_backward", "meta_load",
    })
    variants = {"flat": "use_orig_params=False: each unit's parameters in one flat parameter"}

    def __init__(self, variant: str | None = None) -> None:
        self.use_orig_params = variant != "flat"
        self.name = "torch-fsdp1" + (f"[{variant}]" if variant else "")
        if self.use_orig_params:
            self.capabilities = self.capabilities | {"orig_params"}

    def shard_from_rank0(self, model, spec: ShardSpec):
        """As FSDP1 documents it (and Accelerate's FSDP1 plugin does under fsdp_cpu_ram_efficient_loading):
        `sync_module_states=True` broadcasts rank 0's parameters and buffers as each unit is wrapped, and
        `param_init_fn` gives a skeleton's modules storage first (`to_empty(recurse=False)`)."""
        device = spec.device
        return self.shard(model, spec, sync_module_states=True,
                          param_init_fn=lambda module: module.to_empty(device=device, recurse=False))

    def shard(self, model, spec: ShardSpec, **loading):
        if dist.get_backend() == "threaded":
            raise Unsupported(ON_THREADS)
        def policy(path):
            mp = spec.mixed_precision_of(path)
            # cast_forward_inputs: FSDP1's docs ask for it where units' param_dtypes differ
            return FSDPMixedPrecision(param_dtype=mp.param_dtype, reduce_dtype=mp.reduce_dtype, buffer_dtype=mp.buffer_dtype,
                                      keep_low_precision_grads=mp.keep_low_precision_grads,
                                      cast_forward_inputs=bool(spec.unit_mixed_precision)) if mp else None

        device = spec.device

        def wrap(module, path):
            strategy, kwargs = spec.strategy_of(path), {}
            if strategy.startswith("HYBRID"):
                if spec.mesh is None or spec.mesh.ndim != 2:
                    raise ValueError("HYBRID_SHARD needs a 2-D (replicate, shard) mesh on CPU")
                kwargs["device_mesh"] = spec.mesh
            elif spec.mesh is not None:
                kwargs["process_group"] = spec.mesh.get_group()
            return FSDP(module, sharding_strategy=ShardingStrategy[strategy], mixed_precision=policy(path),
                        cpu_offload=CPUOffload(offload_params=spec.offload), device_id=device,
                        use_orig_params=self.use_orig_params, **kwargs, **loading)

        for path, module in spec.unit_modules(model):
            _set(model, path, wrap(module, path))
        return wrap(model, "")

    def prepare(self, model, spec: ShardSpec, recipe):
        """Parameters kept unsharded between micro-batches (capability `reshard_after_backward`) are
        FSDP1's own doing, with no switch: inside no_sync() a SHARD_GRAD_OP unit does not free them
        after backward ("a heuristic to tradeoff higher memory for higher throughput":
        _runtime_utils._should_free_in_backward), and the first synced backward frees them. Asked of
        any other strategy or of synced micro-batches, it is unsupported."""
        if not recipe.reshard_after_backward and (recipe.sync_each_micro_batch or spec.strategies != {Strategy.SHARD_GRAD_OP}):
            raise Unsupported("FSDP1 keeps parameters unsharded after backward only for SHARD_GRAD_OP inside no_sync() "
                              "(_should_free_in_backward), with no switch of its own")
        return self.shard(model, spec)

    def set_reshard_after_backward(self, model, flag):
        """Nothing to set: FSDP1 keeps them under no_sync() by itself (`prepare`)."""

    def no_sync(self, model):
        return model.no_sync()

    def held_grads(self, model):
        """Under no_sync each unit keeps the unsharded sum on its flat parameter's gradient."""
        return [m._handle.flat_param.grad for m in FSDP.fsdp_modules(model)
                if m._handle is not None and m._handle.flat_param.grad is not None]

    def full_params(self, model):
        with FSDP.summon_full_params(model, writeback=False):
            return {_clean(n): p.detach().clone() for n, p in model.named_parameters()}

    def full_grads(self, model):
        units = FSDP.fsdp_modules(model)
        # summon_full_params(with_grads=True) needs use_orig_params, and with keep_low_precision_grads
        # torch 2.13 refuses its fp16 grad on the fp32 flat param (grad_dtype): gather by hand there.
        if not all(m._use_orig_params and not (m.mixed_precision and m.mixed_precision.keep_low_precision_grads)
                   for m in units):
            grads = _flat_grads(model)
            return {n: grads.get(n) for n in self.full_params(model)}
        with FSDP.summon_full_params(model, writeback=False, with_grads=True):
            return {_clean(n): None if p.grad is None else p.grad.detach().clone()
                    for n, p in model.named_parameters()}

    def clip_grad_norm_(self, model, max_norm, norm_type):
        return model.clip_grad_norm_(max_norm, norm_type)

    def clip_grad_norm_unit_(self, model, path, max_norm):
        return _unit(model, path).clip_grad_norm_(max_norm)

    def grad_scaler(self, **kwargs):
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(**kwargs)

    def register_comm_hook(self, model, state, hook, path=""):
        (_unit(model, path) if path else model).register_comm_hook(state, hook)

    def comm_hooks(self, model):
        return [(m._comm_hook, m._comm_hook_state) for m in FSDP.fsdp_modules(model)]

    def compression_hook(self, dtype):
        from torch.distributed.algorithms._comm_hooks import default_hooks

        hook = {torch.float16: default_hooks.fp16_compress_hook,
                torch.bfloat16: default_hooks.bf16_compress_hook}[dtype]
        return default_hooks.LowPrecisionState(dist.group.WORLD), hook

    def local_shards(self, model):
        raise Unsupported("FSDP1 has no all-gather extensions")
