"""What the parent decides about a test before any rank starts, once per test: its `Plan`.

`make_plan` checks the input (bad input is one `HarnessUsageError` line, never a traceback from
inside torch), settles the mode, and says whether the test must be skipped on this machine (a
backend or a device count it lacks, a launcher that started too few ranks). The pytest plugin makes
the plan in `pytest_runtest_setup`, `shardcheck.harness.run` makes it itself; the runner only carries it out.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardcheck.harness import cuda
from shardcheck.harness.devices import thread_device_type
from shardcheck.harness.launcher import LaunchEnv, detect
from shardcheck.harness.vocabulary import BACKENDS, MODES
from shardcheck.errors import UsageError


class HarnessUsageError(UsageError, ValueError):
    """Bad input from the user: reported as one clear line, never a traceback from inside torch."""


@dataclass(frozen=True)
class Plan:
    world_size: int
    backend: str
    mode: str  # one of vocabulary.MODES
    skip: str | None = None  # why this machine cannot run the test; None when it can
    launch: LaunchEnv | None = None  # the launcher's ranks, in external mode


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise HarnessUsageError(f"unknown backend {backend!r}; choose one of: {', '.join(BACKENDS)}")
    return backend


def check_world_size(world_size) -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise HarnessUsageError(f"invalid world size {world_size!r}: it must be an integer >= 1")
    return world_size


def choose_mode(backend: str, launch: str = "pool", external: bool = False) -> str:
    """The mode of a test: external under a launcher, thread for the threaded backend, else
    `launch` (pool or spawn)."""
    if external:
        return "external"
    return "thread" if backend == "threaded" else launch


def check_mode(mode: str, backend: str) -> str:
    if mode not in MODES:
        raise HarnessUsageError(f"unknown mode {mode!r}; choose one of: {', '.join(MODES)}")
    if (mode == "thread") != (backend == "threaded"):
        raise HarnessUsageError(
            f"mode {mode!r} does not go with backend {backend!r}: thread mode is the 'threaded' backend")
    return mode


def skip_reason(backend: str, world_size: int) -> str | None:
    """Why this (backend, world size) cannot run on this machine, or None if it can."""
    import torch.distributed as dist

    if not dist.is_available():
        return "torch.distributed is not available in this torch build"
    if backend == "gloo" and not dist.is_gloo_available():
        return "gloo backend is not available in this torch build"
    if backend == "nccl":
        if not dist.is_nccl_available():
            return "nccl backend is not available in this torch build (CPU-only torch?)"
        count = cuda.device_count()  # by NVML: the parent forks ranks (shardcheck.harness.cuda)
        if count < world_size:
            return f"nccl at world size {world_size} needs {world_size} CUDA devices; {count} visible"
    if backend == "threaded" and thread_device_type() == "cuda" and cuda.device_count() == 0:
        return "SHARDCHECK_THREAD_DEVICE=cuda but no CUDA device is visible"
    return None


def make_plan(world_size, backend: str, mode: str) -> Plan:
    """Check a test's input and decide how it runs; raises HarnessUsageError on bad input."""
    check_backend(backend)
    check_world_size(world_size)
    check_mode(mode, backend)
    launch = None
    if mode == "external":
        launch = detect()
        if launch is None:
            raise HarnessUsageError("external mode needs ranks started by torchrun or srun")
    skip = skip_reason(backend, world_size)
    if skip is None and launch is not None and world_size > launch.world_size:
        skip = f"needs world size {world_size}; the launcher started {launch.world_size} ranks"
    return Plan(world_size, backend, mode, skip, launch)

