"""The capability vocabulary: what checks may ask for and adapters may declare.

Two layers, matching the two layers of checks:

* *behaviour* capabilities say what a data-parallel trainer can be asked to do at all (shard with a
  strategy, clip with a norm type, scale the loss, compute in lower precision). Any engine can
  declare them: they say nothing about how it does it.
* *api* capabilities say which of torch's FSDP-style APIs the implementation exposes (a
  `clip_grad_norm_` callable on a module whose `p.grad` are live, a sharded GradScaler object,
  FSDP1 comm hooks, FSDP2 all-gather extensions, ...). Only the API-layer checks ask for them.

A check that needs a capability the adapter lacks is *unsupported*: never a pass. An adapter says
why for each capability it leaves out, in its manifest's `[unsupported]` table
(shardcheck.conformance.expectations.manifest.why_not): the engine's own limit, not a convenience skipped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from shardcheck.strategy import Strategy

if TYPE_CHECKING:  # spec imports torch; this vocabulary does not
    from shardcheck.conformance.protocol.spec import Recipe

STRATEGIES = tuple(Strategy)  # FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD, SHARD_OPTIMIZER (shardcheck/strategy.py)

BEHAVIOUR = {
    "full_shard": "FULL_SHARD: parameters, gradients and optimizer state sharded; reshard after forward",
    "shard_grad_op": "SHARD_GRAD_OP: gradients and optimizer state sharded; full parameters kept "
                     "from forward to backward (ZeRO-2)",
    "no_shard": "NO_SHARD: replicated parameters, averaged gradients, the whole optimizer state on every "
                "rank (DDP semantics)",
    "hybrid_shard": "HYBRID_SHARD: shard within groups of a 2-D (replicate, shard) mesh, replicate across",
    "shard_optimizer": "SHARD_OPTIMIZER: replicated parameters and averaged gradients, the optimizer state "
                       "sharded: each rank steps its 1/n and the updated parameters are redistributed "
                       "(ZeRO-1: torch's ZeroRedundancyOptimizer, DeepSpeed stage 1, Megatron's "
                       "distributed optimizer)",
    "clip_norm_1": "clip gradients by their global 1-norm",
    "clip_norm_2": "clip gradients by their global 2-norm",
    "clip_norm_inf": "clip gradients by their global inf-norm",
    "loss_scaling": "dynamic loss scaling: skip the step on inf/NaN anywhere, back off, grow",
    "mixed_precision_bf16": "compute in bfloat16 with float32 master parameters",
    "mixed_precision_fp16": "compute in float16 with float32 master parameters",
    "grad_accumulation": "several micro-batches per optimizer step (Recipe.accumulation_steps), gradients "
                         "summed over them",
    "no_sync": "gradient communication suppressed on all but the last micro-batch "
               "(Recipe.sync_each_micro_batch=False): no_sync(), set_requires_gradient_sync(False)",
    "eval_forward": "Trainer.evaluate(batch): a forward in eval mode without gradients between training steps",
    "unused_params": "a model with parameters the loss never uses (no gradient on any rank)",
    "requires_grad_changes": "parameters frozen or unfrozen between steps (Recipe.requires_grad_at, "
                             "Trainer.set_requires_grad), as fine-tuning schedules do",
    "activation_checkpointing": "a model whose layers are activation-checkpointed (torch.utils.checkpoint, "
                                "checkpoint_wrapper, composable checkpoint) trains as without it",
    "tensor_parallel": "ShardSpec.tensor_parallel: column / row parallel linears over a (dp, tp) mesh's tp "
                       "dimension, the strategy over dp (2-D data x tensor parallel)",
    "compile": "a model whose layers are compiled (torch.compile, backend aot_eager) before sharding trains "
               "as the eager one",
    "gradient_divide_factor": "ShardSpec.gradient_divide_factor f: the reduced gradient is the sum over every "
                              "data-parallel rank (replicate and shard dimensions together) divided by f instead "
                              "of by their number (FSDP2's set_gradient_divide_factor), on 1-D and 2-D meshes",
    "token_weighted_loss": "Recipe.tokens: a token-weighted loss over padded micro-batches, the sum of per-token losses "
                           "divided by the step's global count of target tokens (every rank's micro-batches, agreed "
                           "before the first backward: Trainer.begin_step): the gradient of the global token mean",
    "reshard_after_backward": "Recipe.reshard_after_backward=False: parameters kept unsharded after the backward of all "
                              "but a step's last micro-batch, so later micro-batches gather nothing "
                              "(FSDP2's set_reshard_after_backward)",
    "is_last_backward": "Recipe.mark_last_backward: the engine is told which backward is a step's last (FSDP2's "
                        "set_is_last_backward) and still reduces every backward whose gradient sync is on",
    "buffers": "module buffers (BatchNorm running statistics, non-persistent buffers) kept as DDP keeps them: "
               "broadcast from rank 0 before forward (DDP's broadcast_buffers)",
    "checkpoint": "Trainer.save(path) / load(path) in the engine's own format (resume at the same world size) "
                  "and Trainer.full_state_dict() (the consolidated, unsharded state dict)",
    "checkpoint_reshard": "a checkpoint saved by a trainer on some ranks loads into one on more or fewer ranks "
                          "(a sub-group of the launch, its own device mesh) and training continues",
}

# Loading a saved model as the front-ends' memory-efficient loading does (issue 60, family models).
BEHAVIOUR |= {
    "meta_load": "Adapter.trainer_from_rank0(model, spec, recipe): the model real on rank 0 alone (its saved weights "
                 "loaded) and a skeleton on the meta device on the other ranks; every rank ends with rank 0's "
                 "parameters and buffers (non-persistent ones too, rotary inv_freq), tied weights still tied "
                 "(Accelerate's fsdp_cpu_ram_efficient_loading, FSDP1's sync_module_states, FSDP2's "
                 "set_model_state_dict(broadcast_from_rank0=True))",
}

# Mixtures of experts (issue 60, the loop's knobs).
BEHAVIOUR |= {
    "idle_experts": "Recipe.routed: experts that get tokens on some ranks and none on others in a step, or none on any: "
                    "the gradient of unsharded data-parallel training (DDP with find_unused_parameters): the sum over "
                    "the ranks that used the expert divided by the world size, on every rank; None, and skipped by the "
                    "optimizer, only in a step where no rank used it",
    "expert_mesh": "ShardSpec.unit_meshes: a unit (a mixture of experts' experts) sharded over a 2-D mesh of its own "
                   "(sharded over its second dimension, replicated over its first: torchtitan's fully_shard of the "
                   "experts over dp_shard_mod_ep) while the rest of the model shards over the 1-D data-parallel mesh; "
                   "every gradient still the mean over all data-parallel ranks",
}

API = {
    "mixed_strategy": "different strategies for different units of one model",
    "nested_units": "sub-modules sharded as their own units inside a sharded root",
    "orig_params": "the sharded module exposes its original parameters by name (per-parameter "
                   "requires_grad after sharding); FSDP1's flat parameters do not",
    "mixed_precision": "FSDP-style MixedPrecision (param/reduce/buffer dtypes) on ShardSpec",
    "keep_low_precision_grads": "gradients left in the reduce dtype",
    "per_unit_mixed_precision": "a policy per unit (ShardSpec.unit_mixed_precision): a float32 norm or head among "
                                "bfloat16 units, each unit casting the activations it receives to its own dtype",
    "buffer_dtype": "MixedPrecision.buffer_dtype: a unit's floating buffers (BatchNorm statistics, registered "
                    "constants) cast to it for forward",
    "cpu_offload": "sharded parameters and gradients kept on the CPU",
    "clip_grad_norm": "clip_grad_norm_ over the live p.grad of a sharded module (torch's API)",
    "sharded_grad_scaler": "a GradScaler object whose found_inf is agreed across ranks",
    "comm_hooks": "register_comm_hook on the root with per-unit introspection",
    "compression_hooks": "fp16/bf16 gradient compression hooks",
    "all_gather_extensions": "fsdp_pre_all_gather / fsdp_post_all_gather on local shards",
    "meta_init": "shard on the meta device, then to_empty() and initialise",
    "dtensor_tensor_parallel": "torch's DTensor TP styles (ColwiseParallel, RowwiseParallel, SequenceParallel) on a "
                               "2-D (dp, tp) mesh, composed with the engine's sharding (the api seed cells)",
    "dtensor_grads": "gradients are DTensors, so collectives can be counted with CommDebugMode",
}

CAPABILITIES = {**BEHAVIOUR, **API}


def of_strategy(strategy: str) -> str:
    """The capability a sharding strategy needs: `FULL_SHARD` -> `full_shard`."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown sharding strategy {strategy!r}; one of {', '.join(STRATEGIES)}")
    return strategy.lower()


def of_norm(norm_type: float) -> str:
    """The capability clipping with `norm_type` needs: 2.0 -> `clip_norm_2`, inf -> `clip_norm_inf`."""
    return "clip_norm_inf" if norm_type == float("inf") else f"clip_norm_{int(norm_type)}"


def of_loop(recipe: Recipe) -> set[str]:
    """The capabilities a recipe's loop shape needs (spec.Recipe): accumulation, sync suppression,
    evaluation between steps, frozen parameters (per-parameter requires_grad: `orig_params`), unused
    parameters, requires_grad changed between steps, and the knobs: a token-weighted loss, parameters
    kept unsharded between micro-batches, the last backward marked, experts idle on some ranks. Tied parameters need none: every trainer must train the model it is given."""
    needed = set()
    if recipe.accumulation_steps > 1:
        needed.add("grad_accumulation")
        if not recipe.sync_each_micro_batch:
            needed.add("no_sync")
    if recipe.eval_every:
        needed.add("eval_forward")
    if recipe.frozen:
        needed.add("orig_params")
    if recipe.unused:
        needed.add("unused_params")
    if recipe.requires_grad_at:
        needed |= {"requires_grad_changes", "orig_params"}
    if recipe.tokens is not None:
        needed.add("token_weighted_loss")
    if not recipe.reshard_after_backward:
        needed.add("reshard_after_backward")
    if recipe.mark_last_backward:
        needed.add("is_last_backward")
    if recipe.routed:
        needed.add("idle_experts")
    return needed


def unknown(names: Iterable[str]) -> list[str]:
    """The names that are not in the vocabulary (a typo must not silently mean 'unsupported')."""
    return sorted(set(names) - set(CAPABILITIES))
