"""Hugging Face Accelerate's FSDP behind the behaviour protocol (optional: `pip install -e '.[accelerate]'`).

Driven as its documentation says: `Accelerator(mixed_precision=..., fsdp_plugin=FullyShardedDataParallelPlugin(
fsdp_version, sharding_strategy | reshard_after_forward, mixed_precision_policy))`, `accelerator.prepare`,
`accelerator.backward(loss)`, `accelerator.clip_grad_norm_(model.parameters(), max_norm, norm_type)`,
`optimizer.step()`; full parameters and gradients are read from torch's FSDP module (frontends.py).
Variants: FSDP1 (default: the model prepared, then the optimizer built over it and prepared, the order
FSDP1 needs), `joint` (FSDP1, `prepare(model, optimizer)` with the optimizer built first: F28), `fsdp2`
(`fsdp_version=2`, `reshard_after_forward`; model and optimizer prepared together, as FSDP2 requires),
Checkpoints: `accelerator.save_state` / `load_state` (SHARDED_STATE_DICT) and `get_state_dict` (export).
`unshimmed` (FSDP1 as a user builds it on a CPU machine, `Accelerator(cpu=True, ...)`: F27), `config`
(the user's own config file: accelerate_config.py). On CPU the shim `fsdp_on_cpu` below is needed.
Units (`spec.unit_modules`) are the plugin's `auto_wrap_policy` (`wrap_for`): for FSDP1 a callable (torch's
`lambda_auto_wrap_policy` over the units); for FSDP2 `"transformer_based_wrap"` with the units' class
names, the only forms its `prepare` honours (a callable is dropped, silently: FINDINGS F38), so units
no set of classes picks out alone are unsupported there.
HYBRID_SHARD for FSDP2: `Accelerator(parallelism_config=ParallelismConfig(dp_replicate_size, dp_shard_size))`;
for FSDP1 the plugin's sharding_strategy alone (no mesh reaches FSDP1: F62).
Not declared: loss scaling (Accelerate scales only fp16 on an accelerator device), NO_SHARD for FSDP2
(Accelerate runs pure data parallelism as DDP).
"""

from __future__ import annotations

import importlib.metadata
import os

import torch

from shardcheck.strategy import Strategy
from shardcheck.conformance.adapters import dcp, frontends
from shardcheck.conformance.protocol import ParameterHolders, StepResult, Unsupported, evaluation_loss
from shardcheck.conformance.protocol.documented import FLOAT32, Documented

try:
    from accelerate import Accelerator, PartialState
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, GradientAccumulationPlugin
except ImportError as exc:
    raise ImportError(f"accelerate is not importable ({exc}): pip install -e '.[accelerate]' "
                      "(torch pinned first, README)") from None
from shardcheck.conformance.adapters import accelerate_config  # noqa: E402 (needs pyyaml, which accelerate brings)

PRECISION = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def fsdp_on_cpu(accelerator, plugin, parallelism=None) -> None:
    """The CPU shim: what accelerate/state.py does for an accelerator device (MULTI_GPU & co), done for
    MULTI_CPU, where it keeps the plugin out and `prepare` wraps in DDP instead (FINDINGS). A
    ParallelismConfig is applied here, as Accelerator.__init__ does, once the state is FSDP (its check
    refuses MULTI_CPU)."""
    for state in (PartialState(), accelerator.state):  # AcceleratorState() re-copies PartialState's dict
        state.distributed_type = DistributedType.FSDP  # state.py sets it only for an accelerator device
        state.device = torch.device("cpu")  # MULTI_CPU's is cpu:<local rank>; FSDP1 refuses device_id != 'cpu'
    accelerator.state.fsdp_plugin = plugin  # state.py keeps it only for an accelerator device
    if accelerator.state.mixed_precision != "no":
        plugin.set_mixed_precision(accelerator.state.mixed_precision)  # ditto (keeps a policy already set)
    if parallelism is not None:
        accelerator.state.parallelism_config = parallelism
        accelerator.state.device_mesh = parallelism.get_device_mesh("cpu")
        parallelism._validate_accelerator(accelerator)


def wrap_for(spec, model, version: int) -> dict:
    """The plugin's wrap policy for `spec`'s units ({} without units), as the plugin's docs give it."""
    if not spec.unit_modules(model):
        return {}
    if version == 1:  # FSDP(auto_wrap_policy=...) takes any callable policy
        return {"auto_wrap_policy": frontends.wrap_policy(spec, model)}
    # fsdp2_prepare_auto_wrap_policy knows transformer_auto_wrap_policy (by the class names) and size only
    return {"auto_wrap_policy": "transformer_based_wrap",
            "transformer_cls_names_to_wrap": frontends.unit_class_names(
                spec, model, "Accelerate's FSDP2 (a callable auto_wrap_policy is ignored: F38)")}


def plugin_for(spec, model, recipe, version: int):
    """The plugin and mixed_precision a user writes for `spec`: strategy, units, compute, reduce and
    (FSDP1) buffer dtypes and low-precision gradients; for FSDP1 `use_orig_params=True` where the
    recipe freezes parameters, as Accelerate's docs ask for fine-tuning with frozen layers (FSDP1
    refuses mixed requires_grad in a flat parameter), its flat parameters otherwise."""
    mp, policy = spec.mixed_precision, None
    if mp is not None:
        from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy
        fsdp1 = {"buffer_dtype": mp.buffer_dtype, "keep_low_precision_grads": mp.keep_low_precision_grads}
        policy = (MixedPrecision if version == 1 else MixedPrecisionPolicy)(
            param_dtype=mp.param_dtype, reduce_dtype=mp.reduce_dtype, **(fsdp1 if version == 1 else {}))
    strategy = {"sharding_strategy": spec.strategy} if version == 1 else \
        {"reshard_after_forward": spec.strategy != Strategy.SHARD_GRAD_OP}
    if version == 1 and (recipe.frozen or recipe.requires_grad_at):
        strategy["use_orig_params"] = True
    if spec.offload:  # FSDP2 takes the policy object; pinned memory needs an accelerator
        from torch.distributed.fsdp import CPUOffloadPolicy
        strategy["cpu_offload"] = CPUOffloadPolicy(pin_memory=False)
    # save_state's format: sharded through DCP, as Accelerate's FSDP guide recommends (FSDP2's default;
    # FSDP1's default FULL_STATE_DICT offloads to CPU, which fails on a CPU model before torch 2.14: F58)
    strategy["state_dict_type"] = "SHARDED_STATE_DICT"
    return (FullyShardedDataParallelPlugin(fsdp_version=version, mixed_precision_policy=policy, **strategy,
                                           **wrap_for(spec, model, version)),
            PRECISION.get(mp and mp.param_dtype, "no"))


def parallelism_for(spec):
    """HSDP as Accelerate's docs give it for FSDP2: a ParallelismConfig of (dp_replicate, dp_shard) sizes,
    from which the Accelerator builds its device mesh; None for the 1-D strategies."""
    if spec.strategy != Strategy.HYBRID_SHARD:
        return None
    from accelerate import ParallelismConfig

    replicate, shard = spec.mesh.shape
    if shard == 1:  # Accelerate: "FSDP is enabled but the parallelism config has no dimension for FSDP to shard across"
        raise Unsupported("Accelerate refuses a ParallelismConfig with dp_shard_size 1 under FSDP (pure data parallelism is DDP)")
    return ParallelismConfig(dp_replicate_size=replicate, dp_shard_size=shard)


class AccelerateTrainer:
    def __init__(self, model, recipe, plugin, mixed_precision, shim, joint, parallelism=None):
        AcceleratorState._reset_state(reset_partial_state=True)  # accelerate's state is a process-wide singleton
        self.holders = ParameterHolders(model)  # before the front-end wraps it (set_requires_grad)
        os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))  # else MULTI_CPU resets threads
        accumulation = {}
        if recipe.accumulation_steps > 1:  # accelerator.accumulate counts micro-batches; backward divides by k
            accumulation["gradient_accumulation_plugin"] = GradientAccumulationPlugin(
                num_steps=recipe.accumulation_steps, adjust_scheduler=False, sync_with_dataloader=False,
                sync_each_batch=recipe.sync_each_micro_batch)
        if parallelism is not None and not shim:
            accumulation["parallelism_config"] = parallelism
        self.accelerator = Accelerator(cpu=True, fsdp_plugin=plugin, mixed_precision=mixed_precision, **accumulation)
        if shim:
            fsdp_on_cpu(self.accelerator, plugin, parallelism)
        if joint:  # the optimizer built over the unsharded model, both prepared together
            self.model, self.optimizer = self.accelerator.prepare(model, recipe.optimizer.build(model.parameters()))
        else:  # FSDP1's recommended order: prepare the model, then build the optimizer over it and prepare that
            self.model = self.accelerator.prepare(model)
            self.optimizer = self.accelerator.prepare(recipe.optimizer.build(self.model.parameters()))
        if not self.accelerator.is_fsdp2 and not frontends.is_fsdp1(self.model):
            raise AssertionError(f"Accelerator.prepare with an fsdp_plugin returned {type(self.model).__name__}, "
                                 f"not FSDP ({self.accelerator.distributed_type})")
        self.recipe = recipe

    def forward_backward(self, batch):
        """As Accelerate's users accumulate: every micro-batch inside `accelerator.accumulate(model)`,
        which syncs on the k-th only (or every one: `sync_each_batch`) and divides the loss by k."""
        with self.accelerator.accumulate(self.model):
            loss = self.recipe.loss_fn(self.model, batch)
            self.accelerator.backward(loss)
        return loss.detach()

    def set_requires_grad(self, names, flag):
        self.holders.set_requires_grad(names, flag)

    def evaluate(self, batch):
        return evaluation_loss(self.model, self.recipe.loss_fn, batch)

    def full_grads(self):
        return frontends.full_grads(self.model)

    def step(self):
        clip, total = self.recipe.clip, None
        if clip is not None:
            total = self.accelerator.clip_grad_norm_(self.model.parameters(), clip.max_norm, clip.norm_type)
            total = float(total.full_tensor() if hasattr(total, "full_tensor") else total)
        self.optimizer.step()
        self.optimizer.zero_grad()
        return StepResult(total_norm=total)

    # Capability `checkpoint`: as Accelerate's docs checkpoint (accelerator.save_state / load_state: the
    # model, optimizer and RNG states; the plugin's state_dict_type decides the format) and export
    # (accelerator.get_state_dict: the full state dict, on rank 0).
    def save(self, path):
        self.accelerator.save_state(str(path))

    def load(self, path):
        self.accelerator.load_state(str(path))

    def full_state_dict(self):
        return frontends.from_rank0(self.accelerator.get_state_dict(self.model))

    def full_optimizer_state(self):  # Accelerate has no in-memory one: torch's, over the optimizer it wraps
        return dcp.full_optimizer_state(self.model, self.optimizer.optimizer)

    def full_params(self):
        # not accelerator.get_state_dict: for FSDP1 on CPU its FULL_STATE_DICT(offload_to_cpu=True) fails (FINDINGS)
        return frontends.full_params(self.model)


class AccelerateAdapter:
    name = "accelerate"
    version = importlib.metadata.version("accelerate")
    # A model loaded in bf16 under mixed precision trains float32 master weights: FSDP upcasts them
    # (accelerator.prepare; accelerate#2674, its concept guide on FSDP and DeepSpeed precision).
    documented = Documented(FLOAT32, "https://huggingface.co/docs/accelerate/concept_guides/fsdp_and_deepspeed")
    variants = {"fsdp2": "FullyShardedDataParallelPlugin(fsdp_version=2): fully_shard underneath",
                "joint": "FSDP1, accelerator.prepare(model, optimizer) with the optimizer built before sharding",
                "unshimmed": "FSDP1 plugin as a user builds it on a CPU machine (Accelerator(cpu=True)), no shim"}
    if os.environ.get(accelerate_config.ENV):  # only then: `--impl all` and explore have a config to judge
        variants["config"] = f"the Accelerate config file ${accelerate_config.ENV} names (accelerate_config.py)"

    def __init__(self, variant: str | None = None) -> None:
        self.variant = variant
        self.name = f"accelerate[{variant}]" if variant else "accelerate"
        strategies = {"full_shard", "shard_grad_op", "hybrid_shard"} | ({"no_shard"} if variant != "fsdp2" else set())  # config: per cell
        self.capabilities = frozenset(strategies | {"clip_norm_1", "clip_norm_2", "clip_norm_inf",
                                                    "mixed_precision_bf16", "mixed_precision_fp16",
                                                    "grad_accumulation", "no_sync", "eval_forward", "unused_params", "requires_grad_changes",
                                                    "activation_checkpointing", "buffers", "compile", "checkpoint"}
                                                   | ({"orig_params"} if variant in ("fsdp2", None) else set())
                                                   | ({"meta_init"} if variant is None else set())
                                                   | ({"cpu_offload"} if variant == "fsdp2" else set())
                                                   | ({"buffer_dtype", "keep_low_precision_grads", "mixed_precision"} if variant != "fsdp2" else set()))

    def trainer(self, model, spec, recipe):
        frontends.require_processes("Accelerate", spec)
        mp = spec.mixed_precision
        if len(spec.strategies) > 1:
            raise Unsupported("one sharding strategy per Accelerator")
        if spec.offload and "cpu_offload" not in self.capabilities:
            raise Unsupported("FSDP1's CPUOffload pins memory: F2")
        if mp and mp.keep_low_precision_grads and "keep_low_precision_grads" not in self.capabilities:
            raise Unsupported("FSDP2's MixedPrecisionPolicy has no keep_low_precision_grads")
        if mp and mp.buffer_dtype and "buffer_dtype" not in self.capabilities:
            raise Unsupported("FSDP2's MixedPrecisionPolicy has no buffer_dtype")
        if self.variant == "config":  # the user's own config file (accelerate_config.py)
            kwargs, mixed_precision = accelerate_config.load(FullyShardedDataParallelPlugin)
            accelerate_config.check_cell(kwargs, mixed_precision, spec)
            if "auto_wrap_policy" not in kwargs:  # the file's own policy stands; without one, the cell's units
                kwargs.update(wrap_for(spec, model, int(kwargs.get("fsdp_version", 1))))
            plugin = FullyShardedDataParallelPlugin(**kwargs)
        else:
            plugin, mixed_precision = plugin_for(spec, model, recipe, 2 if self.variant == "fsdp2" else 1)
        return AccelerateTrainer(model, recipe, plugin, mixed_precision, shim=self.variant != "unshimmed",
                                 joint=plugin.fsdp_version == 2 or self.variant == "joint",
                                 parallelism=parallelism_for(spec) if plugin.fsdp_version == 2 else None)
