"""Helpers shared by the clip-grad checks (test_clip_grad*.py)."""

from __future__ import annotations

import contextlib
import math
import threading
import warnings

import torch
import torch.nn as nn

from shardcheck.conformance.checks.support import models as M
from shardcheck.conformance.protocol import ShardSpec

INF = math.inf
LR = 1e-2


# ---------------------------------------------------------------- helpers


def shard_spec_of(model: nn.Module, variant: str | None = None, **kwargs) -> ShardSpec:
    """A ShardSpec from the model's WrapSpec: units innermost first, per-unit strategies."""
    units, strategies = [], {}
    root_strategy = kwargs.pop("strategy", "FULL_SHARD")
    for path, opts in M.resolve_units(model, variant):
        strategy = opts.get("sharding_strategy")
        if path == "":
            root_strategy = strategy or root_strategy
            continue
        units.append(path)
        if strategy:
            strategies[path] = strategy
    return ShardSpec(strategy=root_strategy, units=tuple(units), unit_strategies=strategies, **kwargs)


def norm_of(t: torch.Tensor, norm_type: float) -> float:
    return torch.linalg.vector_norm(t.float(), ord=norm_type).item()


def detached_copies(tensors: dict) -> dict:
    """Detached copies: an adapter may hand back views of live gradients (e.g. a Replicate DTensor's
    full_tensor()), which in-place clipping would then change under our feet."""
    return {n: None if t is None else t.detach().clone() for n, t in tensors.items()}


def grads_of(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}


def assert_clipped(before: dict, after: dict, max_norm: float, norm_type: float, what: str) -> None:
    """Every gradient norm <= max_norm after clipping; every non-zero gradient was changed."""
    for name, g in after.items():
        if g is None:
            assert before[name] is None, f"{what}: {name} lost its gradient in clip_grad_norm_"
            continue
        norm = norm_of(g, norm_type)
        assert norm <= max_norm, f"{what}: {name} has norm {norm} > max_norm {max_norm} after clipping"
        if g.numel() and torch.count_nonzero(before[name]):
            assert not torch.equal(g, before[name]), f"{what}: {name} was not changed by clipping"


_CAPTURE_LOCK = threading.Lock()
_CAPTURE = {"users": 0, "cm": None, "log": None}


@contextlib.contextmanager
def record_warnings():
    """warnings.catch_warnings(record=True) that works when ranks are threads of one process.

    catch_warnings swaps process-global state, so concurrent per-thread uses would clobber each other;
    here the first rank in installs one shared recorder and the last one out removes it. Callers filter
    the (shared) log by their rank."""
    with _CAPTURE_LOCK:
        if _CAPTURE["users"] == 0:
            cm = warnings.catch_warnings(record=True)
            _CAPTURE["log"] = cm.__enter__()
            warnings.simplefilter("always")
            _CAPTURE["cm"] = cm
        _CAPTURE["users"] += 1
        log = _CAPTURE["log"]
    try:
        yield log
    finally:
        with _CAPTURE_LOCK:
            _CAPTURE["users"] -= 1
            if _CAPTURE["users"] == 0:
                _CAPTURE["cm"].__exit__(None, None, None)
                _CAPTURE["cm"] = _CAPTURE["log"] = None


def all_reduce_count(comm_mode) -> int:
    """All-reduces seen by CommDebugMode, whichever op namespace issued them."""
    return sum(n for op, n in comm_mode.get_comm_counts().items()
               if "all_reduce" in str(op) or "allreduce" in str(op))


