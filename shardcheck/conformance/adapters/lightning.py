"""Lightning Fabric's FSDP behind the behaviour protocol (optional: `pip install -e '.[lightning]'`).

Driven as its documentation says: `Fabric(accelerator="cpu", devices=N, strategy=..., precision=...)`,
`fabric.launch()`, then either `fabric.setup(model, optimizer)` (the optimizer built before sharding) or
`fabric.setup_module(model)`, the optimizer over the sharded module, `fabric.setup_optimizers(optimizer)`;
`fabric.backward(loss)`, `fabric.clip_gradients(model, optimizer, max_norm, norm_type)`, `optimizer.step()`.
Full parameters and gradients are read from torch's FSDP module underneath (frontends.py): Fabric has
no in-memory full state. Variants: `FSDPStrategy` (default; FSDP1, joint setup), `late-optimizer`
(FSDPStrategy, setup_module -> optimizer -> setup_optimizers), `model-parallel` (`ModelParallelStrategy`
with `fully_shard` as its parallelize_fn: FSDP2, the order its docs show), `model-parallel-joint`
(ModelParallelStrategy, `fabric.setup(model, optimizer)`: FINDINGS), `unshimmed` (FSDPStrategy as a user
builds it on CPU: Fabric refuses it, FINDINGS). Units (`spec.unit_modules`): FSDPStrategy's
`auto_wrap_policy` (a callable, frontends.wrap_policy); ModelParallelStrategy's parallelize_fn calls
`fully_shard` on each unit, then on the root, as Lightning's FSDP2 guide does per layer. Precision:
"bf16-mixed" / "16-mixed" with float32 gradient reduction. FSDPStrategy needs the CPU shim
`CpuFSDPStrategy`; ModelParallelStrategy none.
Checkpoints: `fabric.save` / `fabric.load` (sharded, DCP underneath).
ModelParallelStrategy's NO_SHARD and HYBRID_SHARD: the parallelize_fn shards over the (world, 1) or the
(replicate, shard) mesh a user builds for HSDP (Lightning's own mesh is (data, tensor) parallel).
Not declared: loss scaling (only "16-mixed"'s scaler, never over float32 compute); for ModelParallelStrategy
fp16 (it refuses "16-mixed").
"""

from __future__ import annotations

import importlib.metadata

import torch
import torch.distributed as dist

from shardcheck.strategy import Strategy
from shardcheck.conformance.adapters import dcp, frontends
from shardcheck.conformance.adapters.torch_fsdp2 import strategy_mesh
from shardcheck.conformance.protocol import ParameterHolders, StepResult, Unsupported, evaluation_loss, on_meta

try:
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import FSDPStrategy, ModelParallelStrategy
except ImportError as exc:
    raise ImportError(f"lightning is not importable ({exc}): pip install -e '.[lightning]' "
                      "(torch pinned first, README)") from None

PRECISION = {torch.bfloat16: "bf16-mixed", torch.float16: "16-mixed"}


class CpuFSDPStrategy(FSDPStrategy):
    """The CPU shim. Fabric's connector refuses `type(strategy) is FSDPStrategy` off a GPU: a subclass
    passes. `setup_module` wraps with `device_id=root_device.index`, None on CPU, which FSDP1 refuses
    there ("needs a non-CPU accelerator device"): the same wrap with `device_id=cpu`."""

    def setup_module(self, module):
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(module, cpu_offload=self.cpu_offload, mixed_precision=self.mixed_precision_config,
                                        sharding_strategy=self.sharding_strategy, device_id=torch.device("cpu"),
                                        **self._fsdp_kwargs)


def strategy_for(variant, spec, model):
    mp = spec.mixed_precision
    if variant.startswith("model-parallel"):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=mp.param_dtype, reduce_dtype=mp.reduce_dtype) if mp else MixedPrecisionPolicy()

        def parallelize(model, mesh):  # the user's parallelize_fn: fully_shard over the data-parallel mesh
            # (FULL_SHARD, SHARD_GRAD_OP), or over the mesh the user builds for HSDP: the spec's 2-D
            # (replicate, shard) mesh for HYBRID_SHARD, a (world, 1) one for NO_SHARD, as torch-fsdp2
            hsdp = spec.strategy in (Strategy.NO_SHARD, Strategy.HYBRID_SHARD)
            dp = strategy_mesh(spec.mesh, spec.strategy) if hsdp else mesh["data_parallel"]
            kwargs = dict(mesh=dp, mp_policy=policy, reshard_after_forward=spec.strategy != Strategy.SHARD_GRAD_OP)
            for _, unit in spec.unit_modules(model):  # each unit (deepest first), then the root
                fully_shard(unit, **kwargs)
            fully_shard(model, **kwargs)
            return model
        return ModelParallelStrategy(parallelize, data_parallel_size=dist.get_world_size(), tensor_parallel_size=1)
    from torch.distributed.fsdp import MixedPrecision

    kwargs = {"device_mesh": spec.mesh} if spec.strategy == Strategy.HYBRID_SHARD else {}
    return (FSDPStrategy if variant == "unshimmed" else CpuFSDPStrategy)(
        sharding_strategy=spec.strategy, **kwargs, auto_wrap_policy=frontends.wrap_policy(spec, model),
        mixed_precision=MixedPrecision(param_dtype=mp.param_dtype, reduce_dtype=mp.reduce_dtype,
                                       buffer_dtype=mp.buffer_dtype,
                                       keep_low_precision_grads=mp.keep_low_precision_grads) if mp else None)


class LightningTrainer:
    def __init__(self, model, spec, recipe, variant):
        mp = spec.mixed_precision
        self.fabric = Fabric(accelerator="cpu", devices=dist.get_world_size(),
                             strategy=strategy_for(variant, spec, model),
                             precision=PRECISION.get(mp and mp.param_dtype, "32-true"))
        self.fabric.launch()
        self.recipe = recipe
        self.holders = ParameterHolders(model)  # before the front-end wraps it (set_requires_grad)
        # A model built on meta (capability meta_init) is set up first and its optimizer after, as Fabric
        # demands ("set up the model and optimizer(s) separately") and its init_module docs show.
        if variant == "model-parallel-joint" or (variant == "default" and not on_meta(model)):
            self.model, self.optimizer = self.fabric.setup(model, recipe.optimizer.build(model.parameters()))
        else:
            self.model = self.fabric.setup_module(model)
            self.optimizer = self.fabric.setup_optimizers(recipe.optimizer.build(self.model.parameters()))

    def forward_backward(self, batch):
        """As Fabric's users accumulate: `fabric.no_backward_sync(model, enabled=...)` around the
        micro-batches that must not sync (when the recipe syncs the last only), loss / k."""
        k = self.recipe.accumulation_steps
        self.micro = getattr(self, "micro", 0) + 1
        quiet = self.micro % k != 0 and not self.recipe.sync_each_micro_batch
        with self.fabric.no_backward_sync(self.model, enabled=quiet):
            loss = self.recipe.loss_fn(self.model, batch)
            self.fabric.backward(loss / k if k > 1 else loss)
        return loss.detach()

    def set_requires_grad(self, names, flag):
        self.holders.set_requires_grad(names, flag)

    def evaluate(self, batch):
        return evaluation_loss(self.model, self.recipe.loss_fn, batch)

    def full_grads(self):
        return frontends.full_grads(self.model._forward_module)  # the torch FSDP module Fabric wraps

    def step(self):
        clip, total = self.recipe.clip, None
        if clip is not None:
            total = self.fabric.clip_gradients(self.model, self.optimizer, max_norm=clip.max_norm,
                                               norm_type=clip.norm_type)
            total = float(total.full_tensor() if hasattr(total, "full_tensor") else total)
        self.optimizer.step()
        self.optimizer.zero_grad()
        return StepResult(total_norm=total)

    def full_params(self):
        return frontends.full_params(self.model._forward_module)  # the torch FSDP module Fabric wraps

    # Capability `checkpoint`: as Fabric's docs checkpoint, `fabric.save(path, state)` / `fabric.load(path,
    # state)` with the model and optimizer in `state` (both strategies' default: sharded, through DCP).
    # Fabric has no in-memory export: the full state dict is read from the torch module it wraps.
    def save(self, path):
        self.fabric.save(path, {"model": self.model, "optimizer": self.optimizer})

    def load(self, path):
        self.fabric.load(path, {"model": self.model, "optimizer": self.optimizer})

    def full_state_dict(self):
        return dcp.full_state_dict(self.model._forward_module)

    def full_optimizer_state(self):  # the torch optimizer Fabric wraps, over the torch module's parameters
        return dcp.full_optimizer_state(self.model._forward_module, self.optimizer.optimizer)


class LightningAdapter:
    name = "lightning"
    version = importlib.metadata.version("lightning")
    variants = {"late-optimizer": "FSDPStrategy, setup_module -> optimizer -> setup_optimizers",
                "model-parallel": "ModelParallelStrategy (fully_shard), setup_module -> optimizer -> setup_optimizers",
                "model-parallel-joint": "ModelParallelStrategy, fabric.setup(model, optimizer built before sharding)",
                "unshimmed": "FSDPStrategy as a user builds it on a CPU machine, no shim"}

    def __init__(self, variant: str | None = None) -> None:
        self.variant = variant or "default"
        self.name = f"lightning[{variant}]" if variant else "lightning"
        fsdp2 = self.variant.startswith("model-parallel")  # its precision plugins refuse "16-mixed"
        self.capabilities = frozenset({"full_shard", "shard_grad_op", "clip_norm_1", "clip_norm_2", "clip_norm_inf",
                                       "mixed_precision_bf16", "grad_accumulation", "no_sync", "eval_forward",
                                       "unused_params", "orig_params", "requires_grad_changes", "activation_checkpointing", "buffers", "compile", "checkpoint", "no_shard",
                                       "hybrid_shard"} | (set() if self.variant == "model-parallel-joint" else {"meta_init"}) | (set() if fsdp2 else {"mixed_precision_fp16", "buffer_dtype",
                                                                           "keep_low_precision_grads", "mixed_precision"}))

    def trainer(self, model, spec, recipe):
        frontends.require_processes("Lightning", spec)
        mp = spec.mixed_precision
        if len(spec.strategies) > 1 or spec.offload:
            raise Unsupported("one sharding strategy per Fabric; no offload")
        if mp and mp.keep_low_precision_grads and "keep_low_precision_grads" not in self.capabilities:
            raise Unsupported("FSDP2's MixedPrecisionPolicy has no keep_low_precision_grads")
        if mp and mp.buffer_dtype and "buffer_dtype" not in self.capabilities:
            raise Unsupported("FSDP2's MixedPrecisionPolicy has no buffer_dtype")
        return LightningTrainer(model, spec, recipe, self.variant)
