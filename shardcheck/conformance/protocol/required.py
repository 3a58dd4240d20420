"""What an adapter must provide for what it declares, checked when it loads (`adapters.load`), so that
an adapter's own gap is one line naming the method, not a failure of every cell as if the engine
were wrong.

A `TorchStyleAdapter` (the trainer is written once, from the adapter's API methods) needs `shard`,
`full_params`, `full_grads`, and per capability: `clip_grad_norm_` to clip, `grad_scaler` to scale the
loss, its own `no_sync` for `no_sync` (`set_reshard_after_backward`, `set_is_last_backward` for the
knobs of those names), its own `shard_from_rank0` for `meta_load`, and the four checkpoint methods for
`checkpoint`. Any other
adapter's trainer is checked where `trainer()`'s return annotation names its class: the `Trainer`
methods (`forward_backward`, `full_grads`, `step`, `full_params`), `evaluate` for `eval_forward`,
`set_requires_grad` for `requires_grad_changes`, `begin_step` for `token_weighted_loss`, and `save`, `load`,
`full_state_dict`, `full_optimizer_state` for `checkpoint` (the methods of the protocols `Trainer`,
`EvaluatingTrainer`, `FineTuningTrainer`, `TokenCountingTrainer`, `CheckpointingTrainer` in adapter.py; a
stub inherited from one of them is not an implementation). A trainer class the annotation does not name
(or a protocol named instead) is met only when a cell builds it.
"""

from __future__ import annotations

import typing
from typing import Any, Callable

from shardcheck.conformance.protocol.adapter import (CheckpointingTrainer, EvaluatingTrainer, FineTuningTrainer,
                                                     TokenCountingTrainer, Trainer, methods_of)
from shardcheck.conformance.protocol.torch_style import TorchStyleAdapter

CHECKPOINT_API = ("save_checkpoint", "load_checkpoint", "full_state_dict", "full_optimizer_state")
# The trainer's methods, as its protocols (protocol/adapter.py) declare them: one list for the
# author's type checker and for this check.
CHECKPOINT_TRAINER = methods_of(CheckpointingTrainer)
TRAINER = methods_of(Trainer)


Declared = Callable[[set[str]], bool]  # a test of the declared capabilities
Needs = tuple[tuple[str, ...], tuple[tuple[Declared, tuple[str, ...]], ...]]


def _named(capability: str) -> Declared:
    return lambda declared: capability in declared


# What each kind of adapter needs: always, then per declared capability (a test of the declared set).
TORCH_STYLE_NEEDS: Needs = (("shard", "full_params", "full_grads"), (
    (lambda declared: any(c.startswith("clip_norm_") for c in declared), ("clip_grad_norm_",)),
    (_named("loss_scaling"), ("grad_scaler",)),
    (_named("checkpoint"), CHECKPOINT_API)))
TRAINER_NEEDS: Needs = (TRAINER, (
    (_named("eval_forward"), methods_of(EvaluatingTrainer)),
    (_named("requires_grad_changes"), methods_of(FineTuningTrainer)),
    (_named("token_weighted_loss"), methods_of(TokenCountingTrainer)),
    (_named("checkpoint"), CHECKPOINT_TRAINER)))
# Loop knobs a TorchStyleAdapter maps onto its engine by overriding the base's refusal: capability -> method.
TORCH_STYLE_OVERRIDES = {"no_sync": "no_sync", "reshard_after_backward": "set_reshard_after_backward",
                         "is_last_backward": "set_is_last_backward", "meta_load": "shard_from_rank0"}


def _needs(needs: Needs, capabilities: set[str]) -> list[str]:
    always, per_capability = needs
    return [*always, *(m for declared, methods in per_capability if declared(capabilities) for m in methods)]


def trainer_class(adapter: object) -> type | None:
    """The class `adapter.trainer` says it returns (its return annotation), or None: not named, or
    only a protocol (`Trainer`, `CheckpointingTrainer`, ...: what the type checker holds it to)."""
    try:
        hint = typing.get_type_hints(getattr(type(adapter), "trainer")).get("return")
    except Exception:  # an annotation naming what the module does not import: not checkable here
        return None
    return hint if isinstance(hint, type) and not vars(hint).get("_is_protocol", False) else None


def _implemented(cls: type, name: str) -> bool:
    """Whether `cls` has the method `name` of its own: a protocol's stub it inherits (a trainer that
    derives from CheckpointingTrainer, say) is no implementation."""
    home = next((klass for klass in cls.__mro__ if name in vars(klass)), None)
    return home is not None and not vars(home).get("_is_protocol", False) and callable(getattr(cls, name, None))


def missing(adapter: Any) -> list[str]:
    """What `adapter` lacks for what it declares, as "where.method" ([] when complete)."""
    caps = set(adapter.capabilities)
    if isinstance(adapter, TorchStyleAdapter):
        gaps = [f"{type(adapter).__name__}.{m}" for m in _needs(TORCH_STYLE_NEEDS, caps) if not callable(getattr(adapter, m, None))]
        gaps += [f"{type(adapter).__name__}.{m} (declared, not overridden)" for c, m in TORCH_STYLE_OVERRIDES.items()
                 if c in caps and getattr(type(adapter), m) is getattr(TorchStyleAdapter, m)]
        return gaps
    cls = trainer_class(adapter)
    if cls is None:
        return []
    return [f"{cls.__name__}.{m}" for m in _needs(TRAINER_NEEDS, caps) if not _implemented(cls, m)]
