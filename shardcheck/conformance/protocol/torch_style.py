"""The training step of an implementation that exposes torch's APIs, written once.

`TorchStyleAdapter.trainer` shards with `shard`, builds the recipe's torch optimizer over the
sharded module's parameters (or the adapter's own wrapping optimizer: `optimizer`), and runs the step the way torch users write it:

    loss = loss_fn(model, batch); scaler.scale(loss).backward()
    scaler.unscale_(optimizer); total = clip_grad_norm_(model, max_norm, norm_type)
    scaler.step(optimizer); scaler.update(); optimizer.zero_grad(set_to_none=True)

so torch-style adapters (reference, FSDP1, FSDP2, DDP) implement only the API methods.

The loop around it (spec.Recipe) is written as users write it too: with k micro-batches each loss
is divided by k before backward, and when gradients are synced on the last micro-batch only, the
first k-1 backwards run inside the adapter's `no_sync(model)` (FSDP1/DDP `no_sync()`, FSDP2
`set_requires_gradient_sync(False)`); `evaluate` runs `model.eval()` under `torch.no_grad()`.

The knobs (spec.Recipe): with `reshard_after_backward=False` each micro-batch starts with the
adapter's `set_reshard_after_backward(model, last)`, with `mark_last_backward` with its
`set_is_last_backward(model, last)`, as torch's own accumulation tests set FSDP2's flags before each
micro-batch. A token-weighted loss (`tokens`) is written as users write it for an engine that
averages gradients over the data-parallel ranks: `begin_step` all-reduces the step's token count N
(a sum over the data-parallel ranks), and each micro-batch backpropagates ``loss * D / N`` where D is
the engine's divisor (the number of data-parallel ranks, or the spec's gradient divide factor), so
the averaged gradient is the global token mean; nothing is divided by the number of micro-batches.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from shardcheck.conformance.protocol.adapter import ParameterHolders, StepResult, evaluation_loss, materialize, on_meta
from shardcheck.conformance.protocol.outcomes import Unsupported
from shardcheck.conformance.protocol.spec import Recipe, ShardSpec


class TorchStyleTrainer:
    def __init__(self, adapter: Any, model: nn.Module, spec: ShardSpec, recipe: Recipe, from_rank0: bool = False) -> None:
        # adapter: a TorchStyleAdapter, whose API methods the step calls are its subclass's (TorchAPI's,
        # each under its capability): Any to the type checker
        self.adapter, self.recipe, self.spec = adapter, recipe, spec
        self.holders = ParameterHolders(model)  # before sharding (set_requires_grad)
        if from_rank0:  # real on rank 0, meta elsewhere (capability meta_load): the adapter fills every rank
            self.model = adapter.shard_from_rank0(model, spec)
        else:
            self.model = adapter.prepare(model, spec, recipe)
            if on_meta(self.model):  # built on meta (capability meta_init): this rank's shards only
                materialize(self.model, spec.device)
        self.optimizer = adapter.optimizer(self.model, spec, recipe)
        self.scaler: Any = None  # torch.amp.GradScaler's API
        if recipe.loss_scale is not None:
            ls = recipe.loss_scale
            # The group named, as the api checks do: torch's ShardedGradScaler defaults to
            # `dist.group.WORLD` evaluated when its module is first imported, a group that may be
            # gone by now (a later world of the threaded backend, or a re-made process group).
            self.scaler = adapter.grad_scaler(device=spec.device.type, process_group=torch.distributed.group.WORLD,
                                              init_scale=ls.init_scale,
                                              growth_factor=ls.growth_factor,
                                              backoff_factor=ls.backoff_factor,
                                              growth_interval=ls.growth_interval)

    def begin_step(self, micro_batches: Iterable[Any]) -> None:
        """Capability `token_weighted_loss`: the step's global token count N, summed over this
        rank's micro-batches and all-reduced over the data-parallel ranks (before any backward)."""
        tokens = self.recipe.tokens
        assert tokens is not None, "begin_step is called for a recipe with a token count"
        count = torch.zeros((), dtype=torch.float64, device=self.spec.device)
        for batch in micro_batches:
            count += torch.as_tensor(tokens(batch), device=self.spec.device).to(torch.float64)
        dist.all_reduce(count, group=data_parallel_group(self.spec))
        self.tokens = count

    def forward_backward(self, batch: Any) -> torch.Tensor:
        recipe, k = self.recipe, self.recipe.accumulation_steps
        self.micro = getattr(self, "micro", 0) + 1
        last = self.micro % k == 0
        if recipe.mark_last_backward:
            self.adapter.set_is_last_backward(self.model, last)
        if not recipe.reshard_after_backward:
            self.adapter.set_reshard_after_backward(self.model, last)
        quiet = not last and not recipe.sync_each_micro_batch
        with self.adapter.no_sync(self.model) if quiet else contextlib.nullcontext():
            loss: torch.Tensor = recipe.loss_fn(self.model, batch)
            if recipe.tokens is not None:  # the engine divides by D: multiply by it (module doc)
                loss = loss / self.tokens.to(loss.dtype)
                scaled = loss * (self.spec.gradient_divide_factor or data_parallel_size(self.spec))
            else:
                scaled = loss / k if k > 1 else loss
            (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
        return loss.detach()

    def set_requires_grad(self, names: Iterable[str], flag: bool) -> None:
        """What a fine-tuning schedule does between steps: `p.requires_grad_(flag)` on the
        parameters the user's modules hold under `names` (capability `requires_grad_changes`)."""
        self.holders.set_requires_grad(names, flag)

    def held_grads(self) -> list[torch.Tensor] | None:
        """The gradients a no_sync micro-batch left for the last one to reduce, where the adapter
        can show them (None: not observable): the dtype contract reads their dtype."""
        held: list[torch.Tensor] | None = self.adapter.held_grads(self.model)
        return held

    def evaluate(self, batch: Any) -> torch.Tensor:
        """The loss in eval mode without gradients; the model is put back in training mode."""
        return evaluation_loss(self.model, self.recipe.loss_fn, batch)

    def full_grads(self) -> dict[str, torch.Tensor | None]:
        grads: dict[str, torch.Tensor | None] = self.adapter.full_grads(self.model)
        if self.scaler is None:
            return grads
        inv = 1.0 / self.scaler.get_scale()
        return {n: None if g is None else g.float() * inv for n, g in grads.items()}

    def step(self) -> StepResult:
        total = None
        scale_before = self.scaler.get_scale() if self.scaler is not None else None
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        if self.recipe.clip is not None:
            clip = self.recipe.clip
            total = float(self.adapter.clip_grad_norm_(self.model, clip.max_norm, clip.norm_type))
        if self.scaler is None:
            self.optimizer.step()
            skipped, scale = False, None
        else:
            self.scaler.step(self.optimizer)
            self.scaler.update()
            scale = self.scaler.get_scale()
            skipped = scale < scale_before  # GradScaler backs off exactly when it skipped the step
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(total_norm=total, skipped=skipped, scale=scale)

    def full_params(self) -> dict[str, torch.Tensor]:
        return {n: p.float() for n, p in self.adapter.full_params(self.model).items()}

    # Capability `checkpoint`: the adapter's save_checkpoint / load_checkpoint / full_state_dict /
    # full_optimizer_state.
    def save(self, path: str) -> None:
        self.adapter.save_checkpoint(self.model, self.optimizer, self.scaler, str(path))

    def load(self, path: str) -> None:
        self.adapter.load_checkpoint(self.model, self.optimizer, self.scaler, str(path))

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        state: dict[str, torch.Tensor] = self.adapter.full_state_dict(self.model)
        return state

    def full_optimizer_state(self) -> dict[str, dict[str, Any]]:
        state: dict[str, dict[str, Any]] = self.adapter.full_optimizer_state(self.model, self.optimizer)
        return state


class TorchStyleAdapter:
    """Base class of adapters that expose torch's APIs: `trainer` comes from `shard` & co.

    Behaviour capabilities that follow from API ones need not be repeated: a torch-style adapter with
    `clip_grad_norm` clips with any norm type, and one with `sharded_grad_scaler` scales the loss."""

    # Declared for the type checker alone (no attribute at runtime, so that one an adapter lacks is
    # still found when it loads: protocol/required.py): the adapter's name, and the API method the
    # step shards with. The others it implements are TorchAPI's (protocol/adapter.py).
    name: str
    shard: Callable[[nn.Module, ShardSpec], nn.Module]

    def trainer(self, model: nn.Module, spec: ShardSpec, recipe: Recipe) -> TorchStyleTrainer:
        return TorchStyleTrainer(self, model, spec, recipe)

    def trainer_from_rank0(self, model: nn.Module, spec: ShardSpec, recipe: Recipe) -> TorchStyleTrainer:
        """Capability `meta_load` (protocol/adapter.py): the trainer of a model real on rank 0 alone."""
        return TorchStyleTrainer(self, model, spec, recipe, from_rank0=True)

    def shard_from_rank0(self, model: nn.Module, spec: ShardSpec) -> nn.Module:
        """Capability `meta_load`: shard `model`, real on rank 0 and on the meta device elsewhere, and
        give every rank rank 0's parameters and buffers (non-persistent ones too), ties kept."""
        raise Unsupported(f"{self.name}: no loading of a model held by rank 0 alone (meta_load)")

    def prepare(self, model: nn.Module, spec: ShardSpec, recipe: Recipe) -> nn.Module:
        """`shard(model, spec)`; an adapter whose wrapping depends on the loop (DDP's
        find_unused_parameters for `recipe.unused`) overrides this."""
        return self.shard(model, spec)

    def optimizer(self, model: nn.Module, spec: ShardSpec, recipe: Recipe) -> Any:
        """The optimizer the step uses over the sharded `model`: the recipe's torch optimizer by default.
        An engine whose optimizer wraps another (torch's ZeroRedundancyOptimizer, SHARD_OPTIMIZER)
        returns its own; the step needs of it what torch.amp.GradScaler and users need: `step()`,
        `zero_grad(set_to_none=True)` and `param_groups` over the parameters whose `.grad` it steps."""
        return recipe.optimizer.build(model.parameters())

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        """A context in which backward accumulates gradients without communicating them (capability
        `no_sync`); the next backward outside it reduces everything accumulated."""
        raise Unsupported(f"{self.name}: no sync suppression (no_sync) for gradient accumulation")

    def set_reshard_after_backward(self, model: nn.Module, flag: bool) -> None:
        """Capability `reshard_after_backward`: whether the next backward reshards the parameters
        (False: they stay unsharded, and the next forward gathers nothing)."""
        raise Unsupported(f"{self.name}: no switch to keep parameters unsharded between micro-batches")

    def set_is_last_backward(self, model: nn.Module, flag: bool) -> None:
        """Capability `is_last_backward`: whether the next backward is the step's last."""
        raise Unsupported(f"{self.name}: no way to mark a step's last backward")

    def held_grads(self, model: nn.Module) -> list[torch.Tensor] | None:
        """Where this engine keeps the gradients summed across no_sync micro-batches (None: not
        observable, the default)."""
        return None

    @staticmethod
    def implied(capabilities: set[str]) -> frozenset[str]:
        """`capabilities` plus the behaviour capabilities its API capabilities imply."""
        out = set(capabilities)
        if "clip_grad_norm" in out:
            out |= {"clip_norm_1", "clip_norm_2", "clip_norm_inf"}
        if "sharded_grad_scaler" in out:
            out.add("loss_scaling")
        if "mixed_precision" in out:
            out |= {"mixed_precision_bf16", "mixed_precision_fp16"}
        return frozenset(out)


def data_parallel_group(spec: ShardSpec) -> Any:
    """The process group of the data-parallel ranks a token count is summed over: the spec's 1-D mesh,
    its "dp" dimension under tensor parallelism, else the default group (a 2-D (replicate, shard)
    mesh spanning every rank)."""
    if spec.mesh is None:
        return None
    mesh = spec.dp_mesh
    if mesh.ndim == 1:
        return mesh.get_group()
    if mesh.size() != dist.get_world_size():
        raise Unsupported("a token count over a 2-D mesh that is a sub-group of the launch")
    return None


def data_parallel_size(spec: ShardSpec) -> int:
    """How many data-parallel ranks an engine averages gradients over."""
    return spec.dp_mesh.size() if spec.mesh is not None else dist.get_world_size()
