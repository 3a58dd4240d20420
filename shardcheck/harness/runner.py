"""Run one test body on N ranks, in whichever mode was chosen, and return the verdict.

This is the harness's single entry point: the pytest plugin calls `run_task` with the plan it made
at setup (shardcheck/harness/plan.py), `run` (the public API, the benchmark) makes the plan itself. Whatever
the mode, the verdict is decided once, from every rank's result (shardcheck/harness/verdict.py).
Pools are kept per (world size, backend) for the life of the process and replaced after any failure.
A rank that dies while idle between tests is blamed on the test that ran last on it: such deaths
are collected (`take_idle_deaths`) for the plugin to report against that test, and the test that
found the pool dead runs on fresh ranks.
"""

from __future__ import annotations

import atexit
import os
from typing import Callable

from shardcheck.harness.plan import Plan, choose_mode, make_plan
from shardcheck.harness.pool import PoolStartError, RankDiedIdle, RankPool, start_method
from shardcheck.harness.task import RankResult, Task
from shardcheck.harness.verdict import Verdict, decide, not_started

MAX_LIVE_POOLS = 4

_pools: dict[tuple[int, str], RankPool] = {}
_pools_pid = os.getpid()
_external = None
_idle_deaths: list[tuple[str | None, str]] = []  # (test that ran last on the rank, message)


def take_idle_deaths() -> list[tuple[str | None, str]]:
    """Rank deaths found while the ranks were idle since the last call: (culprit test id, message)."""
    deaths = list(_idle_deaths)
    _idle_deaths.clear()
    return deaths


def _pool(world_size: int, backend: str, devices: list[str] | None = None) -> RankPool:
    global _pools, _pools_pid
    if _pools_pid != os.getpid():  # forked (pytest-forked): the inherited pools belong to the parent
        _pools, _pools_pid = {}, os.getpid()
    key = (world_size, backend)
    pool = _pools.get(key)
    if pool is not None and not pool.usable:
        _idle_deaths.extend(pool.idle_deaths())
        pool.kill()
        pool = None
    elif pool is not None and pool.devices != devices:  # this test leased other devices: rebuild
        _idle_deaths.extend(pool.shutdown())
        pool = None
    if pool is None:
        while len(_pools) >= MAX_LIVE_POOLS:  # on 2 cores, idle pools cost memory, not time
            _idle_deaths.extend(_pools.pop(next(iter(_pools))).shutdown())
        _pools.pop(key, None)
        pool = _pools[key] = RankPool(world_size, backend, method=start_method(backend),
                                      devices=devices)
    else:
        _pools[key] = _pools.pop(key)  # most recently used last
    return pool


def pool_devices(world_size: int, backend: str) -> list[str] | None:
    """The devices the live pool for (world size, backend) sits on: leased first when free."""
    pool = _pools.get((world_size, backend)) if _pools_pid == os.getpid() else None
    return pool.devices if pool is not None else None


def prepare(world_size: int, backend: str, devices: list[str] | None = None) -> None:
    """Start (or check) the pool a pool-mode test will run on, before its deadline starts."""
    _pool(world_size, backend, devices)


def _run_on_pool(task: Task, world_size: int, backend: str, timeout: float,
                 devices: list[str] | None) -> list[RankResult]:
    """Run on the cached pool; if a rank is found to have died while idle, blame the test before
    (recorded) and run this one on fresh ranks (no body ran: the ranks meet at the pool's gate first)."""
    try:
        return _pool(world_size, backend, devices).run(task, timeout)
    except RankDiedIdle as exc:
        _idle_deaths.extend(exc.deaths)
    return _pool(world_size, backend, devices).run(task, timeout)


def shutdown_pools() -> list[tuple[str | None, str]]:
    """Stop every pool; returns the idle deaths not yet taken (see `take_idle_deaths`)."""
    if _pools_pid != os.getpid():
        return []
    while _pools:
        _idle_deaths.extend(_pools.popitem()[1].shutdown())
    return take_idle_deaths()


atexit.register(shutdown_pools)


def external_world(launch, backend: str, timeout_s: float):
    global _external
    if _external is None:
        from shardcheck.harness.external import ExternalWorld

        _external = ExternalWorld(launch, backend, timeout_s)
    return _external


def leave_external_world() -> None:
    global _external
    if _external is not None:
        import torch.distributed as dist

        dist.barrier(group=_external.control)
        dist.destroy_process_group()
        _external = None


def _run_on_fresh_ranks(task: Task, world_size: int, backend: str, timeout: float,
                        devices: list[str] | None) -> list[RankResult]:
    """Spawn mode: a pool of new processes for this test alone."""
    pool = RankPool(world_size, backend, method="spawn", mode="spawn", devices=devices)
    try:
        return pool.run(task, timeout)
    finally:
        _idle_deaths.extend(pool.shutdown())


def _results(task: Task, plan: Plan, timeout: float, devices: list[str] | None) -> list[RankResult]:
    """Every rank's result, from the ranks of the plan's mode."""
    if plan.mode == "thread":
        from shardcheck.harness.threads import run_threads

        return run_threads(task, plan.world_size, timeout)
    if plan.mode == "external":
        return external_world(plan.launch, plan.backend, timeout).run(task, plan.world_size)
    if plan.mode == "spawn":
        return _run_on_fresh_ranks(task, plan.world_size, plan.backend, timeout, devices)
    return _run_on_pool(task, plan.world_size, plan.backend, timeout, devices)


def run_task(task: Task, plan: Plan, timeout: float = 300.0, devices: list[str] | None = None) -> Verdict:
    """Carry out a test's plan (see shardcheck.harness.plan) and decide its verdict. `devices`: the ids leased
    for this test (shardcheck.harness.devices); the ranks see only those."""
    if plan.skip:
        return Verdict("skipped", plan.skip, [])
    try:
        results = _results(task, plan, timeout, devices)
    except PoolStartError as exc:
        return not_started(exc)
    return decide(results)


def run(fn: Callable, world_size: int, backend: str = "gloo", mode: str | None = None,
        timeout: float = 300.0, **kwargs) -> Verdict:
    """Run `fn(ctx, **kwargs)` on `world_size` ranks outside pytest. `fn` must be importable."""
    plan = make_plan(world_size, backend, mode or choose_mode(backend))
    return run_task(Task.for_callable(fn, kwargs), plan, timeout)
