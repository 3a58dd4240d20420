"""torchtitan's SimpleFSDP behind the behaviour protocol (optional, installed with --no-deps: README).

`data_parallel(model, mesh, mode, mp_policy)` turns every parameter into a DTensor and recomputes
its replicated value in forward (a parametrization that redistributes to Replicate); the backward of
that redistribute reduces the gradient as `Partial(sum)`: SimpleFSDP **sums** gradients over the
data-parallel ranks by design, so the trainer divides the reduced gradients by dp_size after backward,
where FSDP and unsharded training average too (backpropagating `loss / dp_size`, torchtitan's own
normalisation, would round differently in a low-precision backward when dp_size is not a power of two
and would move its float16 overflow by that factor: not what unsharded training computes). Modes:
FULL_SHARD and SHARD_GRAD_OP -> `fully_shard` (eager autograd keeps the gathered value from forward
to backward; resharding after forward is a graph pass of torchtitan's compiled trainer, numerically
the same), NO_SHARD -> `replicate`, HYBRID_SHARD -> `hybrid_shard` on the (replicate, shard) mesh.
Clipping: `torchtitan.distributed.utils.clip_grad_norm_` (any norm type). No loss scaler (none in
torchtitan), no units (every parameter is its own), none of torch's FSDP APIs. Checkpoints: DCP over
the DTensor state dicts, as torchtitan's CheckpointManager.
"""

from __future__ import annotations

import importlib.metadata

import torch

from shardcheck.strategy import Strategy
from shardcheck.conformance.adapters import dcp
from shardcheck.conformance.adapters.dtensors import full_tensors
from shardcheck.conformance.protocol import StepResult, Unsupported, evaluation_loss, materialize, on_meta

try:
    from torchtitan.distributed.utils import clip_grad_norm_
    from torchtitan.experiments.graph_trainer import simple_fsdp
    from torchtitan.experiments.graph_trainer.simple_fsdp import MixedPrecisionPolicy, data_parallel
except ImportError as exc:  # an optional engine: `--impl all` leaves it out with this reason
    raise ImportError(f"torchtitan is not importable ({exc}): see the README (pip install 'shardcheck[torchtitan]' "
                      "&& pip install --no-deps torchtitan==0.3.0)") from None

MODES = {Strategy.FULL_SHARD: "fully_shard", Strategy.SHARD_GRAD_OP: "fully_shard", Strategy.NO_SHARD: "replicate",
         Strategy.HYBRID_SHARD: "hybrid_shard"}


def cast_inputs(dtype: torch.dtype):
    """A forward pre-hook casting floating inputs to `dtype` (SimpleFSDP casts only parameters)."""
    return lambda _, args: tuple(a.to(dtype) if torch.is_tensor(a) and a.is_floating_point() else a
                                 for a in args)


class SimpleFSDPTrainer:
    def __init__(self, model, spec, recipe):
        mp = spec.mixed_precision
        policy = MixedPrecisionPolicy(mp.param_dtype, mp.reduce_dtype) if mp else None
        # Its wrapper classes are cached per module class and keep the FIRST call's mesh, mode and
        # policy (FINDINGS F17): a fresh cache, so that this model gets its own.
        simple_fsdp._wrap_class_cache.clear()
        self.model = data_parallel(model, spec.mesh, MODES[spec.strategy], policy)
        if on_meta(self.model):  # built on meta: each parameter's DTensor allocates its shard alone
            materialize(self.model, spec.device)
        if mp and mp.param_dtype:
            self.model.register_forward_pre_hook(cast_inputs(mp.param_dtype))
        self.recipe, self.dp_size = recipe, spec.mesh.size()
        self.optimizer = recipe.optimizer.build(self.model.parameters())

    def forward_backward(self, batch):
        """loss / k backward (k micro-batches per step); the gradient it adds, summed over the ranks,
        divided by W before it joins what earlier micro-batches left: g += sum_r(grad_r) / W. Every
        backward reduces (SimpleFSDP has no way to hold gradients unreduced: no `no_sync`)."""
        k = self.recipe.accumulation_steps
        params = list(self.model.parameters())
        held = [p.grad for p in params]
        for p in params:
            p.grad = None
        loss = self.recipe.loss_fn(self.model, batch)
        (loss / k if k > 1 else loss).backward()
        for p, h in zip(params, held):
            if p.grad is not None:  # summed over the ranks: the mean is sum(g) / W
                p.grad.div_(self.dp_size)
            if h is not None:
                p.grad = h if p.grad is None else h.add_(p.grad)
        return loss.detach()

    def evaluate(self, batch):
        return evaluation_loss(self.model, self.recipe.loss_fn, batch)

    def full_grads(self):
        return full_tensors({n: p.grad for n, p in self.model.named_parameters()})

    def step(self):
        clip, total = self.recipe.clip, None
        if clip is not None:
            total = float(clip_grad_norm_(list(self.model.parameters()), clip.max_norm, clip.norm_type))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(total_norm=total)

    def full_params(self):
        return {n: t.float() for n, t in full_tensors({n: p.detach() for n, p in self.model.named_parameters()}).items()}

    # Capability `checkpoint`: DCP over the DTensor state dict, as torchtitan's CheckpointManager
    # saves it (torchtitan/components/checkpoint.py: dcp.save of get_model/optimizer_state_dict).
    def save(self, path):
        dcp.save(self.model, self.optimizer, None, str(path))

    def load(self, path):
        dcp.load(self.model, self.optimizer, None, str(path))

    def full_state_dict(self):
        return dcp.full_state_dict(self.model)

    def full_optimizer_state(self):
        return dcp.full_optimizer_state(self.model, self.optimizer)


class SimpleFSDPAdapter:
    name = "torchtitan-simplefsdp"
    version = importlib.metadata.version("torchtitan")
    capabilities = frozenset({"full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "clip_norm_1",
                              "clip_norm_2", "clip_norm_inf", "mixed_precision_bf16", "mixed_precision_fp16",
                              "grad_accumulation", "eval_forward", "unused_params", "meta_init",
                              "activation_checkpointing", "buffers", "compile", "checkpoint",
                              "checkpoint_reshard"})

    def trainer(self, model, spec, recipe):
        if len(spec.strategies) > 1 or spec.offload:
            raise Unsupported("SimpleFSDP: one mode per model, no CPU offload")
        return SimpleFSDPTrainer(model, spec, recipe)
