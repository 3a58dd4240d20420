"""How a model says which of its sub-modules become sharded units: data that adapters apply."""

from __future__ import annotations

import copy
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn as nn

from shardcheck.harness.context import manual_seed


# --------------------------------------------------------------------------
# Wrapping specifications (data consumed by adapters)
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardUnit:
    """One explicitly named sharded unit.

    ``path`` is the dotted submodule path in the *unwrapped* model ("" is the
    root). ``options`` are per-unit overrides of the adapter's kwargs, using
    implementation-neutral strings, e.g. ``{"sharding_strategy": "NO_SHARD"}``.
    """

    path: str
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class WrapSpec:
    """How a seed turns a model into sharded units.

    * ``unit_classes``: every non-root submodule whose type is one of these is a
      unit (FSDP1: ``auto_wrap_policy=ModuleWrapPolicy(unit_classes)``;
      FSDP2: ``fully_shard(m)`` for each such ``m``, innermost first).
    * ``unit_paths``: explicitly named units (FSDP1: manual nested
      ``FSDP(...)``; FSDP2: ``fully_shard(model.get_submodule(path))``).
    * ``wrap_root``: the root is a unit too, always wrapped last.
    * ``root_options``: per-unit overrides for the root.

    ``resolve_units`` orders everything post-order (children before parents),
    which is the order FSDP1's auto-wrap and FSDP2's bottom-up
    ``fully_shard`` calls need.
    """

    unit_classes: tuple[type[nn.Module], ...] = ()
    unit_paths: tuple[ShardUnit, ...] = ()
    wrap_root: bool = True
    root_options: Mapping[str, Any] = field(default_factory=dict)
    note: str = ""


ROOT_ONLY = WrapSpec(note="Only the root is a sharded unit.")


@dataclass(frozen=True)
class TPStyle:
    """A tensor-parallel style for one submodule (see ``MLPStack.TP_PLAN``).

    ``kind`` is "colwise" (``ColwiseParallel``), "rowwise"
    (``RowwiseParallel``) or "sequence" (``SequenceParallel``).
    ``output_shard_dim`` set means ``output_layouts=Shard(dim)``;
    ``sequence_dim`` is ``SequenceParallel(sequence_dim=...)``.
    """

    kind: str
    use_local_output: bool = True
    output_shard_dim: int | None = None
    sequence_dim: int | None = None


def _post_order_paths(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(path, module) for every module, children before parents, shared
    modules visited once (mirrors ``torch.distributed.fsdp.wrap._post_order_apply``)."""
    visited = {model}
    out: list[tuple[str, nn.Module]] = []

    def visit(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            if child not in visited:
                visited.add(child)
                visit(child, f"{prefix}.{name}" if prefix else name)
        out.append((prefix, module))

    visit(model, "")
    return out


def resolve_units(
    model: nn.Module, variant: str | None = None
) -> list[tuple[str, dict[str, Any]]]:
    """Ordered ``(path, options)`` list of the units to wrap, root ("") last.

    ``variant`` selects an entry of ``type(model).WRAP_SPECS``; by default the
    model's ``wrap_variant`` attribute (or "default") is used. "root_only" is
    accepted for every model.
    """
    spec = wrap_spec_of(model, variant)
    explicit = {u.path: dict(u.options) for u in spec.unit_paths}
    units: list[tuple[str, dict[str, Any]]] = []
    for path, module in _post_order_paths(model):
        if path == "":
            continue
        if path in explicit or (
            spec.unit_classes and isinstance(module, spec.unit_classes)
        ):
            units.append((path, explicit.get(path, {})))
    missing = set(explicit) - {p for p, _ in units}
    if missing:
        raise ValueError(f"{type(model).__name__}: no submodule at {sorted(missing)}")
    if spec.wrap_root:
        units.append(("", dict(spec.root_options)))
    return units


def unit_paths(model: nn.Module, variant: str | None = None) -> tuple[str, ...]:
    """The paths of the non-root units of ``resolve_units``, innermost first (a ShardSpec's units)."""
    return tuple(path for path, _ in resolve_units(model, variant) if path)


def wrap_spec_of(model: nn.Module, variant: str | None = None) -> WrapSpec:
    variant = variant or getattr(model, "wrap_variant", "default")
    if variant == "root_only":
        return ROOT_ONLY
    specs = getattr(type(model), "WRAP_SPECS", {})
    if variant not in specs:
        raise KeyError(
            f"{type(model).__name__} has no wrap variant {variant!r}; "
            f"known: {sorted(specs) + ['root_only']}"
        )
    return specs[variant]


class ConformanceModel(nn.Module):
    """Interface shared by the FSDP test models (torch's ``FSDPTestModel``)."""

    WRAP_SPECS: ClassVar[Mapping[str, WrapSpec]] = {}
    wrap_variant: str = "default"

    def get_input(self, device: torch.device | str) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def get_loss(self, input, output) -> torch.Tensor:
        return output.sum()

    def run_backward(self, loss: torch.Tensor) -> None:
        loss.backward()


class _BuiltOnce(type(nn.Module)):
    """A deterministic model is built once per process and argument list; later calls get a deep
    copy of it (copying a transformer is several times cheaper than building it, twice per cell of
    the clip checks), and the CPU generator is left exactly where building would have left it, so the
    random draws after the call are the same as with a fresh build."""

    _cache: dict = {}
    _lock = threading.Lock()

    def __call__(cls, *args, **kwargs):
        if not kwargs.get("deterministic"):
            return super().__call__(*args, **kwargs)
        try:
            key = (cls, args, tuple(sorted(kwargs.items())))
            hash(key)
        except TypeError:  # an unhashable option: built every time
            return super().__call__(*args, **kwargs)
        with _BuiltOnce._lock:
            if key not in _BuiltOnce._cache:
                model = super().__call__(*args, **kwargs)
                _BuiltOnce._cache[key] = (copy.deepcopy(model), torch.get_rng_state())
                return model
            pristine, rng_after = _BuiltOnce._cache[key]
        manual_seed(0)  # what building does first (every device's generator)
        torch.set_rng_state(rng_after)
        return copy.deepcopy(pristine)


class RankedModel(ConformanceModel, metaclass=_BuiltOnce):
    """A model built for one rank of a group, with torch's ``FSDPTestModel`` constructor:
    ``cls(rank, world_size, *, deterministic, device, **options)``.

    In this order: ``deterministic`` seeds 0, ``build(**options)`` makes the layers, ``device``
    moves them, and ``deterministic`` puts the model in ``eval()`` where ``EVAL_WHEN_DETERMINISTIC``
    (torch's TransformerWithSharedParams turns dropout off that way). ``rank`` seeds
    ``get_input`` (``seed_input``); ``from_group`` reads rank and size from a process group."""

    EVAL_WHEN_DETERMINISTIC: ClassVar[bool] = False

    def __init__(self, rank: int = 0, world_size: int = 1, *, deterministic: bool = False,
                 device: torch.device | str | None = None, **options: Any) -> None:
        super().__init__()
        self.rank = rank
        self.world_size = world_size
        if deterministic:
            manual_seed(0)
        self.build(**options)
        if device is not None:
            self.to(device)
        if deterministic and self.EVAL_WHEN_DETERMINISTIC:
            self.eval()

    def build(self) -> None:  # pragma: no cover - every model overrides it
        raise NotImplementedError

    @classmethod
    def from_group(cls, group, **kwargs):
        return cls(group.rank(), group.size(), **kwargs)

    def seed_input(self) -> None:
        """torch's convention: a rank's inputs are drawn after seeding ``1 + rank``."""
        manual_seed(1 + self.rank)
