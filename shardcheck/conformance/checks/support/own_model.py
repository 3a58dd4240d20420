"""The user's own model in the family models: `shardcheck run --model my_pkg.models:build` (or the
pytest option `--shardcheck-model`) judges any engine on it, as on the zoo's architectures.

A model is named by one string, `FACTORY[|batches=FN][|wrap=CLASS,CLASS]`, which travels to the
ranks as the cell's parameter and names the cell:

- `FACTORY`, `pkg.module:attr`: called with no argument, returns the `nn.Module` (float32, on the
  CPU or anywhere: the check moves it to the rank's device);
- `batches=FN`, optional: `FN(rank, step)` returns that rank's `(inputs, targets)` for a step
  (`inputs` a tensor or a tuple of them); integer targets take a cross-entropy loss over the output's
  last dimension, float targets a mean-squared loss. Without it, a model whose first module is an
  `nn.Embedding` gets token batches and the next-token cross-entropy of its output (`.logits` where
  it has them); one whose first module is an `nn.Linear` or `nn.Conv2d` gets float batches and a
  mean-squared loss against a fixed target;
- `wrap=CLASS,...`, optional: the class names of the modules sharded as units. Without it, the
  classes transformers names in `_no_split_modules`, else the class repeated in the shallowest
  `nn.ModuleList` or `nn.Sequential` (the decoder layers, the blocks).

Bad input is one line (`problem`): a factory that cannot be imported or raises, something other
than a module, a model without parameters, a wrap class that matches nothing, inputs that cannot be
drawn.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardcheck.conformance.checks.support.workloads import Workload
from shardcheck.errors import UsageError

BATCH, SEQ, IMAGE = 2, 8, 16


class OwnModelError(UsageError, ValueError):
    """The user's model cannot be judged as given: one line saying what is wrong."""


@dataclass(frozen=True)
class OwnModel:
    factory: str
    batches: str | None = None
    wrap: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: str) -> "OwnModel":
        factory, *parts = text.split("|")
        fields = dict(part.split("=", 1) for part in parts if "=" in part)
        wrap = tuple(c for c in fields.get("wrap", "").split(",") if c)
        return cls(factory, fields.get("batches"), wrap)

    def __str__(self) -> str:
        return "|".join([self.factory] + ([f"batches={self.batches}"] if self.batches else []) +
                        ([f"wrap={','.join(self.wrap)}"] if self.wrap else []))


def is_own(name: str) -> bool:
    return ":" in name


def names(config) -> list[str]:
    """The `--shardcheck-model` values of this session, each checked (pytest.UsageError otherwise)."""
    import pytest

    given = config.getoption("shardcheck_model", None) or []
    for text in given:
        if (why := problem(text)) is not None:
            raise pytest.UsageError(f"--shardcheck-model {text}: {why}")
    return list(given)


def load(spec: str) -> Callable:
    """`pkg.module:attr`, imported from the current folder too (as `python -m` would)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise OwnModelError(f"{spec!r} is not pkg.module:attr")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except Exception as exc:  # an ImportError, an AttributeError, or anything the module raised
        raise OwnModelError(f"cannot import {spec}: {type(exc).__name__}: {exc}") from None
    if not callable(obj):
        raise OwnModelError(f"{spec} is not callable")
    return obj


def build(own: OwnModel) -> nn.Module:
    factory = load(own.factory)
    try:
        model = factory()
    except Exception as exc:
        raise OwnModelError(f"{own.factory}() raised {type(exc).__name__}: {exc}") from None
    if not isinstance(model, nn.Module):
        raise OwnModelError(f"{own.factory}() returned a {type(model).__name__}, not a torch.nn.Module")
    if not any(True for _ in model.parameters()):
        raise OwnModelError(f"{own.factory}() returned a {type(model).__name__} without parameters: nothing to shard")
    return model


def problem(text: str) -> str | None:
    """What is wrong with the model `text` names, in one line, or None: the model is built once."""
    try:
        own = OwnModel.parse(text)
        model = build(own)
        units_of(model, own.wrap)
        if own.batches:
            load(own.batches)
        else:
            _default_inputs(model)
    except OwnModelError as exc:
        return str(exc)
    return None


def units_of(model: nn.Module, wrap: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The paths of the modules sharded as units: instances of the `wrap` classes, of transformers'
    `_no_split_modules`, or the repeated children of the shallowest ModuleList / Sequential."""
    classes = set(wrap) or set(getattr(model, "_no_split_modules", None) or ())
    if classes:
        paths = tuple(p for p, m in model.named_modules() if p and type(m).__name__ in classes)
        if wrap and not paths:
            present = sorted({type(m).__name__ for m in model.modules()})
            raise OwnModelError(f"wrap class {', '.join(wrap)} matches no module of the model "
                                f"(its classes: {', '.join(present)})")
        if paths:
            return paths
    containers = sorted(((p.count("."), p, m) for p, m in model.named_modules()
                         if p and isinstance(m, (nn.ModuleList, nn.Sequential))), key=lambda x: (x[0], x[1]))
    for _, path, container in containers:
        kinds = Counter(type(child).__name__ for child in container.children())
        if kinds and kinds.most_common(1)[0][1] >= 2:
            kind = kinds.most_common(1)[0][0]
            return tuple(f"{path}.{name}" for name, child in container.named_children() if type(child).__name__ == kind)
    return ()


def _first_module(model: nn.Module) -> nn.Module:
    return next(m for m in model.modules() if any(True for _ in m.parameters(recurse=False)))


def _default_inputs(model: nn.Module):
    """(draw(generator_device) -> inputs, is_tokens) for a model whose first module is an Embedding,
    a Linear or a Conv2d."""
    first = _first_module(model)
    if isinstance(first, nn.Embedding):
        return (lambda device: torch.randint(0, first.num_embeddings, (BATCH, SEQ), device=device)), True
    if isinstance(first, nn.Linear):
        return (lambda device: torch.randn(BATCH * 2, first.in_features, device=device)), False
    if isinstance(first, nn.Conv2d):
        return (lambda device: torch.randn(BATCH, first.in_channels, IMAGE, IMAGE, device=device)), False
    raise OwnModelError(f"cannot draw inputs for a model whose first module is a {type(first).__name__}: "
                        f"give its batches (--batches pkg.module:batch, batch(rank, step) -> (inputs, targets))")


def _output(out) -> torch.Tensor:
    if hasattr(out, "logits"):
        return out.logits
    if isinstance(out, (tuple, list)):
        return out[0]
    return out


def _fixed_target(out: torch.Tensor) -> torch.Tensor:
    """The same on every rank and step: what a regression head is pulled towards."""
    return torch.sin(torch.arange(out.numel(), device=out.device, dtype=torch.float32)).view(out.shape)


def _loss(model, batch) -> torch.Tensor:
    inputs, targets = batch
    out = _output(model(*inputs) if isinstance(inputs, tuple) else model(inputs)).float()
    if targets is None:  # drawn tokens: the next token of the same sequence
        return F.cross_entropy(out[:, :-1].reshape(-1, out.shape[-1]), inputs[:, 1:].reshape(-1))
    if not targets.is_floating_point():
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), targets.reshape(-1))
    if targets.numel() == 0:  # drawn floats: a fixed target of the output's shape
        return F.mse_loss(out, _fixed_target(out))
    return F.mse_loss(out, targets.float())


def _to(value, device):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple):
        return tuple(_to(v, device) for v in value)
    return value


def workload(text: str) -> Workload:
    """The model `text` names as a workload of the family models (in a rank: the factory is imported there)."""
    own = OwnModel.parse(text)
    model = build(own)
    units = units_of(model, own.wrap)
    if own.batches:
        user_batch = load(own.batches)

        def batches(ctx, steps: int, poison=None) -> list:
            return [_to(tuple(user_batch(ctx.rank, step)), ctx.device) for step in range(steps)]
    else:
        draw, tokens = _default_inputs(model)

        def batches(ctx, steps: int, poison=None) -> list:
            out = []
            for step in range(steps):
                with ctx.seeded(1000 * step + ctx.rank):
                    x = draw(ctx.device)
                out.append((x, None if tokens else torch.empty(0, device=ctx.device)))
            return out
    return Workload(_builder(own), _loss, batches, units)


_BUILDERS: dict[OwnModel, Callable] = {}


def _builder(own: OwnModel) -> Callable:
    """One build function per model in a process: the reference's run is shared by the cells whose
    build is the same object (shared_reference.key)."""
    return _BUILDERS.setdefault(own, lambda: build(own))
