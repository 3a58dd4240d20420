"""The adapter protocol: what a candidate sharding implementation provides to be checked.

An adapter is a small object (well under 100 lines for a new implementation) that knows how to
shard a plain `nn.Module` the way a `ShardSpec` asks, and how to reach the features the checks
exercise. Every check is written once against this protocol. A check that needs a feature the
adapter does not declare in `capabilities` is reported *unsupported* (never a pass, never a failure).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

import pytest
import torch
import torch.nn as nn

# The capability vocabulary. Checks name what they need; adapters declare what they have.
CAPABILITIES = {
    "full_shard": "FULL_SHARD: shard parameters, gradients and optimizer state; reshard after forward",
    "shard_grad_op": "SHARD_GRAD_OP: keep full parameters from forward until after backward",
    "no_shard": "NO_SHARD: replicated parameters, all-reduced gradients (DDP semantics)",
    "hybrid_shard": "HYBRID_SHARD on a 2-D (replicate, shard) mesh",
    "mixed_strategy": "different strategies for different units of one model",
    "nested_units": "sub-modules sharded as their own units inside a sharded root",
    "mixed_precision": "param/reduce/buffer dtypes",
    "keep_low_precision_grads": "gradients left in the reduce dtype",
    "cpu_offload": "sharded parameters and gradients kept on the CPU",
    "orig_params_toggle": "both use_orig_params=True and use_orig_params=False (FSDP1's flat params)",
    "clip_grad_norm": "clip_grad_norm_ over sharded and unsharded gradients",
    "sharded_grad_scaler": "a GradScaler whose found_inf is agreed across ranks",
    "comm_hooks": "register_comm_hook on the root with per-unit introspection",
    "compression_hooks": "fp16/bf16 gradient compression hooks",
    "all_gather_extensions": "fsdp_pre_all_gather / fsdp_post_all_gather on local shards",
    "meta_init": "shard on the meta device, then to_empty() and initialise",
    "tensor_parallel": "2-D data x tensor parallel (DTensor) composition",
    "dtensor_grads": "gradients are DTensors, so collectives can be counted with CommDebugMode",
}


@dataclass(frozen=True)
class MixedPrecision:
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    keep_low_precision_grads: bool = False


@dataclass(eq=False)
class ShardSpec:
    """How to shard a model. `units` are sub-modules (by class, or dotted path) sharded as their own
    units before the root; `unit_strategies` overrides the strategy per dotted path (mixed strategy)."""

    strategy: str = "FULL_SHARD"  # FULL_SHARD | SHARD_GRAD_OP | NO_SHARD | HYBRID_SHARD
    units: tuple = ()
    unit_strategies: dict[str, str] = field(default_factory=dict)
    mixed_precision: MixedPrecision | None = None
    offload: bool = False
    use_orig_params: bool = True
    reshard_after_forward: bool = True
    mesh: Any = None  # a DeviceMesh: 1-D, or 2-D (replicate, shard) for HYBRID_SHARD

    def unit_modules(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """The (path, module) pairs that become units, deepest first, root excluded."""
        found = []
        for path, module in model.named_modules():
            if not path:
                continue
            if any(isinstance(u, type) and isinstance(module, u) for u in self.units) or \
                    path in self.units or path in self.unit_strategies:
                found.append((path, module))
        return sorted(found, key=lambda pm: -pm[0].count("."))

    def strategy_of(self, path: str) -> str:
        return self.unit_strategies.get(path, self.strategy)


UNSUPPORTED_PREFIX = "unsupported:"


class Unsupported(pytest.skip.Exception):
    """Raised by an adapter (or a check) when a cell needs a feature the implementation lacks.

    It travels like a skip, and the plugin reports it with its own status: never a pass."""

    def __init__(self, msg: str) -> None:
        super().__init__(f"{UNSUPPORTED_PREFIX} {msg}")


@runtime_checkable
class Adapter(Protocol):
    """Optional attribute: `expectations`, the path of the adapter's known-failures manifest
    (default conformance/expectations/<name>.toml)."""

    name: str
    version: str
    capabilities: frozenset[str]

    def shard(self, model: nn.Module, spec: ShardSpec) -> nn.Module:
        """Shard `model` (built identically on every rank) as `spec` says; return the root to train."""

    def full_params(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """{name: full parameter} on every rank, names as in the unsharded model. Collective."""

    def full_grads(self, model: nn.Module) -> dict[str, torch.Tensor | None]:
        """{name: full averaged gradient or None} on every rank. Collective."""

    def clip_grad_norm_(self, model: nn.Module, max_norm: float, norm_type: float) -> torch.Tensor:
        """Clip in place; return the total norm as a plain tensor, equal on every rank."""

    def clip_grad_norm_unit_(self, model: nn.Module, path: str, max_norm: float) -> torch.Tensor:
        """Call clip on the non-root unit at `path` (the implementation must refuse)."""

    def grad_scaler(self, **kwargs) -> Any:
        """A sharded grad scaler (torch.amp.GradScaler API, found_inf agreed across ranks)."""

    def register_comm_hook(self, model: nn.Module, state: Any, hook: Callable, path: str = "") -> None:
        """Register `hook` with `state` on the unit at `path` ("" is the root)."""

    def comm_hooks(self, model: nn.Module) -> list[tuple[Any, Any]]:
        """(hook, state) of every unit, root first; (None, None) where none is registered."""

    def compression_hook(self, dtype: torch.dtype) -> tuple[Any, Callable]:
        """The implementation's own (state, hook) that compresses gradients to `dtype`."""

    def local_shards(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """{name: the tensor that is all-gathered from}, for monkey-patching all-gather hooks."""


def require(adapter: Adapter, *capabilities: str) -> None:
    missing = sorted(set(capabilities) - set(adapter.capabilities))
    if missing:
        raise Unsupported(f"{adapter.name} does not declare: {', '.join(missing)}")
