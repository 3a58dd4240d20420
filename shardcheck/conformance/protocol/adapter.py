"""The adapter protocol: what a candidate implementation provides to be judged.

Behaviour layer (every implementation): `trainer(model, spec, recipe)` returns a `Trainer` that
performs the training step its own way (its own backward, optimizer, clipping, loss scaling) and
hands back full parameters and gradients. The behaviour checks compare those, step by step, with
unsharded data-parallel training. `TorchStyleAdapter` (torch_style.py) implements `trainer` from the
API-layer methods below, so an implementation that exposes torch's APIs gets it for free.

API layer (only implementations exposing torch's FSDP-style APIs): the `TorchAPI` methods, each
guarded by an API capability (capabilities.API).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol, runtime_checkable

import torch
import torch.nn as nn

from shardcheck.conformance.protocol.spec import Recipe, ShardSpec


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step reports. `total_norm`: the norm clipping measured (before clipping;
    None without a clip); `skipped`: the update was skipped (inf/NaN under loss scaling); `scale`:
    the loss scale after the step's update (None without loss scaling)."""

    total_norm: float | None = None
    skipped: bool = False
    scale: float | None = None


class ParameterHolders:
    """Who holds each parameter of the user's model, by its unsharded name: recorded before the
    engine wraps the model. Modules survive sharding; parameter objects may not (FSDP2, the
    reference replace them), so `set_requires_grad` flips whatever the modules hold then: the ready
    body of `Trainer.set_requires_grad` (capability `requires_grad_changes`)."""

    def __init__(self, model: nn.Module) -> None:
        self.holders = {f"{path}.{attr}".lstrip("."): (module, attr) for path, module in model.named_modules()
                        for attr, p in module._parameters.items() if p is not None}

    def set_requires_grad(self, names: Iterable[str], flag: bool) -> None:
        for name in names:
            module, attr = self.holders[name]
            getattr(module, attr).requires_grad_(flag)


def evaluation_loss(model: nn.Module, loss_fn: Callable[[nn.Module, Any], torch.Tensor], batch: Any) -> torch.Tensor:
    """An evaluation forward as users write it: `model.eval()`, no gradients, this rank's loss
    (detached), and the model back in training mode. What `Trainer.evaluate` does for an engine
    whose module is the model users call."""
    model.eval()
    try:
        with torch.no_grad():
            return loss_fn(model, batch).detach()
    finally:
        model.train()


@runtime_checkable
class Trainer(Protocol):
    """The candidate's training loop for one model. Collective methods run on every rank."""

    def forward_backward(self, batch: Any) -> torch.Tensor:
        """Forward, `recipe.loss_fn`, backward (scaled when the recipe scales the loss). Returns
        this rank's loss, detached. Called `recipe.accumulation_steps` times per step (one per
        micro-batch); gradients accumulate, and with `sync_each_micro_batch=False` only the last
        call of a step communicates them. With a token-weighted loss (`recipe.tokens`) the loss is
        the micro-batch's sum divided by the step's global count (`begin_step`), and that is returned."""

    def full_grads(self) -> dict[str, torch.Tensor | None]:
        """After `forward_backward`: {name: the full gradient} with names as in the unsharded model,
        averaged over the data-parallel ranks, unscaled, not yet clipped. Collective."""

    def step(self) -> StepResult:
        """Clip (if the recipe clips), optimizer step (skipped on inf/NaN under loss scaling),
        loss-scale update, zero the gradients."""

    def full_params(self) -> dict[str, torch.Tensor]:
        """{name: the full float32 (master) parameter}. Collective."""

    # The optional methods, each with the capability that uses it: the protocols below. shardcheck
    # finds them with hasattr/getattr (protocol/required.py checks them when the adapter loads); a
    # trainer class that derives from the protocols of what its adapter declares (or is annotated
    # with them) lets the author's type checker hold it to their signatures.


class EvaluatingTrainer(Trainer, Protocol):
    """A trainer of an adapter declaring `eval_forward`."""

    def evaluate(self, batch: Any) -> torch.Tensor:
        """This rank's loss of `recipe.loss_fn` in eval mode without gradients (between steps);
        training goes on after it."""


class FineTuningTrainer(Trainer, Protocol):
    """A trainer of an adapter declaring `requires_grad_changes` (a fine-tuning schedule)."""

    def set_requires_grad(self, names: Iterable[str], flag: bool) -> None:
        """Between steps, the parameters named as in the unsharded model stop or start requiring
        gradients, as `p.requires_grad_(flag)` does to the plain model (`ParameterHolders`)."""


class TokenCountingTrainer(Trainer, Protocol):
    """A trainer of an adapter declaring `token_weighted_loss` (Recipe.tokens)."""

    def begin_step(self, micro_batches: Iterable[Any]) -> None:
        """Called before a step's first `forward_backward` with this rank's micro-batches of that step
        (all of them, as a loop that counts tokens fetches them ahead): the trainer counts their
        tokens and agrees the step's global count with the other data-parallel ranks (collective), by
        which each micro-batch's summed loss is then divided."""


class ClosingTrainer(Trainer, Protocol):
    """A trainer with something to release (any capability)."""

    def close(self) -> None:
        """Called once the check is done with the trainer (release hooks, engine state), whether it
        passed or not."""


class CheckpointingTrainer(Trainer, Protocol):
    """A trainer of an adapter declaring `checkpoint` (docs/checkpoints.md); every method collective."""

    def save(self, path: str) -> None:
        """Write the model, optimizer and loss-scaler state into the directory `path` (created if
        needed; nothing written outside it) in the engine's own format."""

    def load(self, path: str) -> None:
        """On a freshly built trainer (possibly at another world size), restore what `save` wrote so
        that training continues the saved trajectory exactly; raise an error naming what is wrong
        (missing file, truncated file, mismatched parameter) on every rank."""

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The consolidated state dict, on every rank, that the plain unsharded model accepts with
        `load_state_dict(strict=True)`."""

    def full_optimizer_state(self) -> dict[str, dict[str, Any]]:
        """{parameter name: {state key: full value}} on every rank, what the optimizer of the
        unsharded model would hold (Adam: step, exp_avg, exp_avg_sq), compared right after a load
        with the uninterrupted run's."""


def methods_of(protocol: type) -> tuple[str, ...]:
    """The methods `protocol` itself declares (not those of the protocols it extends), in order."""
    return tuple(name for name, value in vars(protocol).items() if callable(value) and not name.startswith("_"))


def on_meta(model: nn.Module) -> bool:
    """Whether `model` still has a parameter or buffer on the meta device (no storage yet)."""
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device) -> nn.Module:
    """A model built on the meta device and sharded (capability `meta_init`): `to_empty(device)`
    allocates what this rank holds of each tensor (its shard, not the whole), then the values are
    zeros, and each module's `reset_parameters()` where its parameters are its own (not behind a
    parametrization, whose property is a computed tensor). What the trainer of an engine that takes
    a meta model calls after sharding it."""
    model.to_empty(device=device)
    for t in (*model.parameters(), *model.buffers()):
        t.zero_()
    for module in model.modules():
        reset = getattr(module, "reset_parameters", None)
        if callable(reset) and not getattr(module, "parametrizations", None):
            reset()
    return model


@runtime_checkable
class Adapter(Protocol):
    """Required of every implementation. Optional attributes: `expectations` (the path of its
    known-failures manifest, relative to the adapter's module file; default
    shardcheck/conformance/expectations/<name>.toml), `variants` ({variant: description}; the class is then
    called with `variant=...` for `name[variant]`)."""

    name: str
    version: str
    capabilities: frozenset[str]

    def trainer(self, model: nn.Module, spec: ShardSpec, recipe: Recipe) -> Trainer:
        """Shard `model` (built identically on every rank) as `spec` says, ready to train by `recipe`.
        With capability `meta_init`, `model` may arrive on the meta device: the trainer materializes
        only what this rank holds (`materialize`, after sharding)."""

    # Optional, with the capability `meta_load`: trainer_from_rank0(self, model, spec, recipe) -> Trainer.
    # `model` is real on rank 0 of the spec's mesh alone (its saved weights loaded, as `from_pretrained`
    # loads them) and a skeleton built on the meta device on every other rank (`torch.device("meta")`,
    # `init_empty_weights`): shard it and give every rank rank 0's values, the parameters, the buffers of
    # the state dict and the non-persistent ones (rotary `inv_freq`) alike, with the weights rank 0's
    # model ties still one parameter. What the front-ends' memory-efficient loading does.


class TorchAPI(Protocol):
    """The API layer: torch FSDP-style entry points, each reached only under its capability."""

    def shard(self, model: nn.Module, spec: ShardSpec) -> nn.Module:
        """Shard `model` as `spec` says; return the root, trained with plain `loss.backward()`."""

    def full_params(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """{name: full parameter} on every rank, names as in the unsharded model. Collective."""

    def full_grads(self, model: nn.Module) -> dict[str, torch.Tensor | None]:
        """{name: full averaged gradient or None} on every rank. Collective."""

    def clip_grad_norm_(self, model: nn.Module, max_norm: float, norm_type: float) -> torch.Tensor:
        """Clip in place; return the total norm as a plain tensor, equal on every rank."""

    def clip_grad_norm_unit_(self, model: nn.Module, path: str, max_norm: float) -> torch.Tensor:
        """Call clip on the non-root unit at `path` (the implementation must refuse)."""

    def grad_scaler(self, **kwargs: Any) -> Any:
        """A sharded grad scaler (torch.amp.GradScaler API, found_inf agreed across `process_group`).
        `kwargs`: `device`, `process_group` (always named: a default captured at import may be a
        process group that is gone) and GradScaler's `init_scale`, `growth_factor`, ..."""

    def register_comm_hook(self, model: nn.Module, state: Any, hook: Callable[..., Any], path: str = "") -> None:
        """Register `hook` with `state` on the unit at `path` ("" is the root)."""

    def comm_hooks(self, model: nn.Module) -> list[tuple[Any, Any]]:
        """(hook, state) of every unit, root first; (None, None) where none is registered."""

    def compression_hook(self, dtype: torch.dtype) -> tuple[Any, Callable[..., Any]]:
        """The implementation's own (state, hook) that compresses gradients to `dtype`."""

    def local_shards(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """{name: the tensor that is all-gathered from}, for monkey-patching all-gather hooks."""

    def save_checkpoint(self, model: nn.Module, optimizer: torch.optim.Optimizer, scaler: Any, path: str) -> None:
        """Capability `checkpoint`: the engine's own save of model, optimizer and scaler (None
        without loss scaling) into the directory `path`. Collective."""

    def load_checkpoint(self, model: nn.Module, optimizer: torch.optim.Optimizer, scaler: Any, path: str) -> None:
        """Capability `checkpoint`: the engine's own load of what `save_checkpoint` wrote. Collective."""

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Capability `checkpoint`: the consolidated state dict of the unsharded model. Collective."""

    def full_optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, Any]]:
        """Capability `checkpoint`: {parameter name: {state key: full value}}. Collective."""
