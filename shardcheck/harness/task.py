"""What travels between the parent and the ranks: a test body to run, and each rank's result.

A `Task` names the test body by module and qualified name (never by pickling code), carries the
parameters pytest resolved in the parent, and the seed every rank starts from. `execute` is the one
place a body runs on a rank, whatever the launch mode: it resets per-test state, calls the body and
turns whatever happened into a `RankResult`.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import os
import random
import sys
import time
import traceback
import unittest
from dataclasses import dataclass, field
from typing import Any, Callable

@dataclass
class Task:
    test_id: str
    module: str
    file: str | None
    qualname: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    sys_path: list[str] = field(default_factory=list)
    seq: int = 0  # the pool's running number for this test (set by RankPool.run)

    @classmethod
    def for_callable(cls, fn: Callable, kwargs: dict | None = None, test_id: str | None = None,
                     seed: int = 0) -> "Task":
        module = sys.modules.get(fn.__module__)
        return cls(test_id=test_id or f"{fn.__module__}::{fn.__qualname__}", module=fn.__module__,
                   file=getattr(module, "__file__", None), qualname=fn.__qualname__,
                   kwargs=dict(kwargs or {}), seed=seed, sys_path=list(sys.path))


@dataclass
class RankResult:
    rank: int
    outcome: str  # one of vocabulary.OUTCOMES
    message: str = ""  # traceback for failures, reason for skips
    records: list[tuple[str, Any]] = field(default_factory=list)
    duration: float = 0.0
    stopped: bool = False  # the harness stopped this rank because another rank had failed
    died: bool = False  # the rank's process ended (exit or signal) instead of answering
    refused: bool = False  # the body returned, and failed for what it left behind (shardcheck.harness.isolation)
    failed_at: float | None = None  # time.monotonic() of the failure (system-wide on Linux)
    # {"counts": {group: collectives issued}, "issued": {group: {kind: calls}}} (shardcheck.harness.isolation)
    collectives: dict | None = None


def resolve(task: Task) -> Callable:
    """Find the test body in this process, importing its module if the rank has not seen it yet."""
    for entry in task.sys_path:
        if entry not in sys.path:
            sys.path.append(entry)
    module = sys.modules.get(task.module)
    if module is None or (task.file and getattr(module, "__file__", None) != task.file):
        try:
            module = importlib.import_module(task.module)
        except ImportError:
            module = None
        if module is None or (task.file and getattr(module, "__file__", None) != task.file):
            spec = importlib.util.spec_from_file_location(task.module, task.file)
            module = importlib.util.module_from_spec(spec)
            sys.modules[task.module] = module
            spec.loader.exec_module(module)
    owner, *rest = task.qualname.split(".")
    obj = getattr(module, owner)
    for part in rest:
        if inspect.isclass(obj):
            obj = getattr(obj(), part)  # a method of a test class: bind it to a fresh instance
        else:
            obj = getattr(obj, part)
    return obj


def reset_process_state(seed: int) -> None:
    """Every test starts from the same state, whatever ran before it on this rank."""
    import torch

    from shardcheck.harness.context import manual_seed

    manual_seed(seed)
    random.seed(seed)
    try:
        import numpy

        numpy.random.seed(seed)
    except ImportError:
        pass
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)


def _skip_types() -> tuple[type, ...]:
    types: list[type] = [unittest.SkipTest]
    try:
        import pytest

        types.append(pytest.skip.Exception)
    except ImportError:
        pass
    return tuple(types)


def takes_ctx(fn: Callable) -> str | None:
    """How a body takes its context: "positional" (first parameter, or a generated `*args`
    wrapper), "keyword", or None (it cannot)."""
    params = list(inspect.signature(fn).parameters.values())
    if params and (params[0].name == "ctx" or params[0].kind is inspect.Parameter.VAR_POSITIONAL):
        return "positional"
    return "keyword" if any(p.name == "ctx" for p in params) else None


def _guard():
    """SHARDCHECK_DEVICE_GUARD=1: the body runs under shardcheck.harness.device_guard (host tensors
    mixed with the rank's fail, as on a GPU rank)."""
    if os.environ.get("SHARDCHECK_DEVICE_GUARD") != "1":  # device_guard.ENV (it imports torch)
        return contextlib.nullcontext()
    from shardcheck.harness.device_guard import DeviceGuard

    return DeviceGuard()


def execute(task: Task, ctx, on_failure: Callable[[BaseException], None] | None = None) -> RankResult:
    """Run `task` on this rank with context `ctx`; never raises."""
    start = time.perf_counter()
    result = RankResult(rank=ctx.rank, outcome="passed", records=ctx._records)
    try:
        fn = resolve(task)
        kwargs = dict(task.kwargs)
        with _guard():
            if takes_ctx(fn) == "positional":  # wrappers such as parameterized.expand append their args
                fn(ctx, **kwargs)
            else:
                fn(ctx=ctx, **kwargs)
    except _skip_types() as exc:
        result.outcome, result.message = "skipped", str(getattr(exc, "msg", exc) or exc)
    except BaseException as exc:  # SystemExit and KeyboardInterrupt on a rank are failures too
        result.outcome, result.failed_at = "failed", time.monotonic()
        tb = exc.__traceback__.tb_next if exc.__traceback__ else None  # drop this frame
        result.message = "".join(traceback.format_exception(type(exc), exc, tb))
        if on_failure is not None:
            on_failure(exc)
    result.duration = time.perf_counter() - start
    return result
