"""What an adapter must provide for what it declares, checked when it loads (`adapters.load`), so that
an adapter's own gap is one line naming the method, not a failure of every cell as if the engine
were wrong.

A `TorchStyleAdapter` (the trainer is written once, from the adapter's API methods) needs `shard`,
`full_params`, `full_grads`, and per capability: `clip_grad_norm_` to clip, `grad_scaler` to scale the
loss, its own `no_sync` for `no_sync`, its own `shard_from_rank0` for `meta_load`, and the four
checkpoint methods for `checkpoint`. Any other
adapter's trainer is checked where `trainer()`'s return annotation names its class: the `Trainer`
methods (`forward_backward`, `full_grads`, `step`, `full_params`), `evaluate` for `eval_forward`,
`set_requires_grad` for `requires_grad_changes`, and `save`, `load`, `full_state_dict`,
`full_optimizer_state` for `checkpoint`. A trainer class the annotation does not name is met only
when a cell builds it.
"""

from __future__ import annotations

import typing

from shardcheck.conformance.protocol.adapter import Trainer
from shardcheck.conformance.protocol.torch_style import TorchStyleAdapter

CHECKPOINT_API = ("save_checkpoint", "load_checkpoint", "full_state_dict", "full_optimizer_state")
CHECKPOINT_TRAINER = ("save", "load", "full_state_dict", "full_optimizer_state")
TRAINER = ("forward_backward", "full_grads", "step", "full_params")


def _named(capability: str):
    return lambda declared: capability in declared


# What each kind of adapter needs: always, then per declared capability (a test of the declared set).
TORCH_STYLE_NEEDS = (("shard", "full_params", "full_grads"), (
    (lambda declared: any(c.startswith("clip_norm_") for c in declared), ("clip_grad_norm_",)),
    (_named("loss_scaling"), ("grad_scaler",)),
    (_named("checkpoint"), CHECKPOINT_API)))
TRAINER_NEEDS = (TRAINER, (
    (_named("eval_forward"), ("evaluate",)),
    (_named("requires_grad_changes"), ("set_requires_grad",)),
    (_named("checkpoint"), CHECKPOINT_TRAINER)))


def _needs(needs, capabilities) -> list[str]:
    always, per_capability = needs
    return [*always, *(m for declared, methods in per_capability if declared(capabilities) for m in methods)]


def trainer_class(adapter) -> type | None:
    """The class `adapter.trainer` says it returns (its return annotation), or None: not named, or
    only the `Trainer` protocol itself."""
    try:
        hint = typing.get_type_hints(type(adapter).trainer).get("return")
    except Exception:  # an annotation naming what the module does not import: not checkable here
        return None
    return hint if isinstance(hint, type) and hint is not Trainer else None


def missing(adapter) -> list[str]:
    """What `adapter` lacks for what it declares, as "where.method" ([] when complete)."""
    caps = set(adapter.capabilities)
    if isinstance(adapter, TorchStyleAdapter):
        gaps = [f"{type(adapter).__name__}.{m}" for m in _needs(TORCH_STYLE_NEEDS, caps) if not callable(getattr(adapter, m, None))]
        for method, capability in (("no_sync", "no_sync"), ("shard_from_rank0", "meta_load")):
            if capability in caps and getattr(type(adapter), method) is getattr(TorchStyleAdapter, method):
                gaps.append(f"{type(adapter).__name__}.{method} (declared, not overridden)")
        return gaps
    cls = trainer_class(adapter)
    if cls is None:
        return []
    return [f"{cls.__name__}.{m}" for m in _needs(TRAINER_NEEDS, caps) if not callable(getattr(cls, m, None))]
