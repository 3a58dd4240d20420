"""shardcheck's harness: run one test body on N ranks (pool, spawn, thread or external launch).

It knows nothing about FSDP. In a test module::

    from shardcheck.harness import distributed

    @distributed(world_size=[2, 4])
    def test_all_reduce(ctx):
        t = torch.ones(1) * ctx.rank
        dist.all_reduce(t)
        assert t.item() == sum(range(ctx.world_size))

Where each concern lives:

    vocabulary.py  the words: backends, modes, outcomes
    plan.py        what the parent decides before any rank starts: input checks, mode, skips
    runner.py      run a test's plan in its mode (pools kept per world size and backend); `run`
    pool.py        rank processes reused test after test until one fails (pool and spawn modes); preload
    worker.py      the main loop of one rank process
    isolation.py   what a test may leave behind in a rank process: restored, or refused
    ledger.py      collectives counted per process group on each rank; those not every rank issued
    threads.py     thread mode: torch's threaded process group
    launcher.py    which launcher (torchrun, srun) started this process, from the environment
    external.py    ranks started by torchrun or srun
    waiting.py     the one wait for every rank's result, and what a rank that never answered is
    task.py        what travels to the ranks (Task) and back (RankResult); runs a body on a rank
    context.py     `ctx`, the per-rank context a body receives
    digest.py      a value named by its content in 16 bytes (ranks compare values by digest)
    verdict.py     from every rank's result to the test's verdict
    stacks.py      ranks' Python stacks, cut to the test body
    output.py      what a rank printed, at a bounded size; the pools' temporary folders
    devices.py     each rank's device, and GPU leasing
    cuda.py        what a process that forks ranks may learn of CUDA without initialising it (NVML)
    device_guard.py  a second device on the CPU: host tensors mixed with the rank's fail (SHARDCHECK_DEVICE_GUARD=1)
    deadline.py    a test's time limit, taken over from pytest-timeout
    plugin.py      the pytest plugin (registered by shardcheck.pytest_plugin, the one entry point)
    xdist_support.py, forked_compat.py   `-n gpus`, and pytest-forked on pytest >= 9.2
    overhead_bench.py  per-test overhead of each mode: `python -m shardcheck.harness.overhead_bench`
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Sequence

from shardcheck.harness.vocabulary import BACKENDS

if TYPE_CHECKING:  # what a type checker reads (at runtime each name comes from its module on first use)
    import pytest

    from shardcheck.harness.context import RankContext
    from shardcheck.harness.plan import HarnessUsageError
    from shardcheck.harness.pool import preload
    from shardcheck.harness.runner import run
    from shardcheck.harness.verdict import Verdict

__all__ = ["BACKENDS", "HarnessUsageError", "RankContext", "Verdict", "distributed", "preload", "run"]

# Imported on first use (PEP 562): the pytest plugin imports this package in every session of an
# environment where shardcheck is installed, and torch only comes with what runs a test.
_LAZY = {"RankContext": "shardcheck.harness.context", "HarnessUsageError": "shardcheck.harness.plan", "preload": "shardcheck.harness.pool",
         "run": "shardcheck.harness.runner", "Verdict": "shardcheck.harness.verdict"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'shardcheck.harness' has no attribute {name!r}")


def distributed(world_size: int | Sequence[int] = 2, *, backend: str | None = None,
                timeout: float | None = None) -> pytest.MarkDecorator:
    """Mark a test to run on `world_size` ranks (an int, or a list: one pytest item per size).

    `backend` fixes the backend for this test (default: the session's --shardcheck-backend); `timeout` is the
    per-test deadline in seconds (default: pytest-timeout's marker/option, else --shardcheck-rank-timeout).
    """
    import pytest

    return pytest.mark.distributed(world_size=world_size, backend=backend, timeout=timeout)
