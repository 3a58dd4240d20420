"""Thread mode: every rank is a thread of this process, joined by torch's threaded process group.

This is the ONLY module of the project that imports `torch.testing._internal` (private, changes every
release, needs `expecttest`); keep it that way.

Threads cannot be killed: a hung rank is reported with its stack, the threaded group's terminate
event wakes ranks blocked in a collective, and a rank sleeping in Python is left behind as a daemon
thread (it dies with the process, and the next test gets a fresh threaded world).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time

import torch
import torch.distributed as dist

from shardcheck.harness.context import RankContext
from shardcheck.harness.devices import device_for, settle_numerics
from shardcheck.harness.isolation import Baseline, Settings, leftovers, refuse
from shardcheck.harness.stacks import thread_stack
from shardcheck.harness.task import RankResult, Task, execute, reset_process_state
from shardcheck.harness.waiting import no_result, unfinished, wait_for_ranks

_RUN_LOCK = threading.Lock()  # one threaded world at a time per process


def _threaded_pg():
    from torch.testing._internal.distributed import multi_threaded_pg  # the one import of torch.testing._internal

    if not hasattr(multi_threaded_pg.ThreadLocalWorld, "comms"):
        # torch 2.11's destroy_process_group finalizes `_world.comms`, which its threaded world
        # lacks (later releases add it): every rank thread's teardown raised AttributeError
        multi_threaded_pg.ThreadLocalWorld.comms = property(
            lambda self: self._get_world().__dict__.setdefault("comms", []))
    return multi_threaded_pg


# The threaded group's collectives are Python methods of its backend, never a dispatcher op: a
# dispatch mode sees none of them. These methods are tapped instead (`tap_collectives`).
TAPPED = ("allreduce", "allreduce_coalesced", "allgather", "broadcast", "reduce_scatter", "alltoall",
          "alltoall_base", "scatter", "gather", "barrier")
_taps = threading.local()  # per thread: .callbacks (this thread's), .depth (inside a tapped method)
_TAP_LOCK = threading.Lock()


@contextlib.contextmanager
def tap_collectives(callback):
    """While the block runs on this thread, call `callback(method, args, backend)` as each collective
    this thread issues on a threaded process group starts: `method` is the backend's (allreduce,
    allgather, reduce_scatter, broadcast, ...), `args` its arguments (lists of tensors). A barrier,
    and a method called by another (all_gather_single calls allgather), are not reported."""
    _install_taps(_threaded_pg().ProcessLocalGroup)
    callbacks = _taps.__dict__.setdefault("callbacks", [])
    callbacks.append(callback)
    try:
        yield
    finally:
        callbacks.remove(callback)


def _install_taps(backend: type) -> None:
    with _TAP_LOCK:
        if backend.__dict__.get("_shardcheck_tapped"):
            return
        for name in TAPPED:
            if name in backend.__dict__:
                setattr(backend, name, _tapped(name, backend.__dict__[name]))
        backend._shardcheck_tapped = True


def _tapped(name: str, method):
    @functools.wraps(method)
    def collective(self, *args, **kwargs):
        depth = getattr(_taps, "depth", 0)
        if depth == 0 and name != "barrier":
            for callback in getattr(_taps, "callbacks", ()):
                callback(name, args, self)
        _taps.depth = depth + 1
        try:
            return method(self, *args, **kwargs)
        finally:
            _taps.depth = depth
    return collective


def _handing_over_the_baton(call, take_back=lambda: True):
    """`call()` without this rank thread's baton (see `_install_baton`), taken back after it unless
    `take_back()` says no (a world stopped by a failure or the deadline unwinds without it)."""
    baton = getattr(_taps, "baton", None)
    if baton is None:
        return call()
    _taps.baton = None
    baton.release()
    try:
        return call()
    finally:
        if take_back():
            baton.acquire()
            _taps.baton = baton


def _install_baton(collective_class: type) -> None:
    """One rank thread of a world runs at a time: each holds its world's baton (`_taps.baton`) from
    the start of its body to its end and hands it over only while it waits: in a collective
    (`Collective.join`, the threaded group's one blocking point) or on the store (`BatonStore`).
    Without it the rank threads fought over the interpreter lock at every kernel (what it saves:
    docs/speed.md)."""
    with _TAP_LOCK:
        if collective_class.__dict__.get("_shardcheck_baton"):
            return
        join = collective_class.join

        @functools.wraps(join)
        def join_handing_over(self, rank, data):
            return _handing_over_the_baton(lambda: join(self, rank, data),
                                           take_back=lambda: not self._pg._terminate.is_set())

        collective_class.join = join_handing_over
        collective_class._shardcheck_baton = True


class BatonStore(dist.Store):
    """A world's store (a HashStore) that hands the baton over while a rank thread waits on it: the
    rendezvous of `new_group` and device meshes waits there for the other ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = dist.HashStore()

    def get(self, key):
        return _handing_over_the_baton(lambda: self.inner.get(key))

    def wait(self, keys, *timeout):
        return _handing_over_the_baton(lambda: self.inner.wait(keys, *timeout))

    def set(self, key, value):
        return self.inner.set(key, value)

    def add(self, key, amount):
        return self.inner.add(key, amount)

    def check(self, keys):
        return self.inner.check(keys)

    def compare_set(self, key, expected, desired):
        return self.inner.compare_set(key, expected, desired)

    def delete_key(self, key):
        return self.inner.delete_key(key)

    def num_keys(self):
        return self.inner.num_keys()

    def set_timeout(self, timeout):
        return self.inner.set_timeout(timeout)


def run_threads(task: Task, world_size: int, timeout: float) -> list[RankResult]:
    mtpg = _threaded_pg()
    _install_baton(mtpg.Collective)
    with _RUN_LOCK:
        settings, before = Settings.capture(), Baseline.take()
        reset_process_state(task.seed)
        torch._C._distributed_c10d._set_thread_isolation_mode(True)
        world = mtpg._install_threaded_pg()
        # One intra-op thread per rank, as in a pool's rank (worker.py): the rank threads already
        # share the cores, and OpenMP's spinning pool cost the threaded clip_grad file 12 of its 72
        # CPU-seconds on 2 cores (settings.restore() puts the caller's count back).
        torch.set_num_threads(1)
        try:
            results, threads = _run_in_world(task, world_size, timeout, mtpg, world)
        finally:
            mtpg.ProcessLocalGroup.reset()
            mtpg._uninstall_threaded_pg()
            torch._C._distributed_c10d._set_thread_isolation_mode(False)
        # Rank threads share one process: what a body left is found once, for every rank (a rank
        # thread stuck past the deadline is already reported as a hang).
        left = leftovers(before, ignore_threads=threads)
        for res in results:
            refuse(res, left)
        settings.restore()
        return results


ALONE_S = 1.0  # how long a rank may wait in a collective whose missing ranks have all returned
UNWIND_S = 2.0  # how long the rank threads of a finished test get to end (a hung one is left)


def os_threads() -> set[int]:
    """The ids of this process's OS threads now (Linux; elsewhere an empty set)."""
    try:
        return {int(tid) for tid in os.listdir("/proc/self/task")}
    except OSError:
        return set()


def wait_for_os_exit(before: set[int], end: float) -> set[int]:
    """Wait (until monotonic time `end`) for the OS threads started since `before` to be gone;
    returns those still there.

    `Thread.join` returns before the OS thread has ended: it then runs its thread-local and
    pthread-key destructors, and so do the OpenMP workers a rank's MKL gemm started (they are
    released as the rank thread exits). MKL's destructor (mm_cleanup_thread_cbk -> mm_free_all_banks)
    holds a spinlock of MKL's memory book while it frees the thread's buffers; a pool forked in
    that moment (the next gloo test) inherits the lock held, and its rank spins forever in its first
    gemm (mkl_serv_allocate -> mm_account_ptr_by_tid). Seen in CI as a rank hung in `x @ x.T`."""
    left = os_threads() - before
    while left and time.monotonic() < end:
        time.sleep(0.001)
        left &= os_threads()
    return left


def _unmatched(threads, pending: set[int], alone_since: dict[int, float], mtpg) -> dict[int, RankResult]:
    """Ranks that have waited ALONE_S in a collective of the threaded group (one over every rank)
    whose missing ranks have all returned: its collectives wait for every rank, and none is left
    to join, so each is an unmatched collective, failed (woken by the group's termination event)
    rather than at the deadline. Read from the group's current collectives (their arrivals), never
    from the threads' frames, which another thread must not touch."""
    stuck: set[int] = set()
    for collective in list(mtpg.ProcessLocalGroup._cur_coll_on_pgs.values()):
        arrived = list(collective._data)
        if len(arrived) != len(threads):
            continue  # a sub-group's: its ranks are numbered within it
        missing = [r for r, data in enumerate(arrived) if data is None]
        if missing and not any(threads[r].is_alive() for r in missing):
            stuck |= {r for r, data in enumerate(arrived) if data is not None} & pending
    now = time.monotonic()
    for r in set(alone_since) - stuck:
        del alone_since[r]
    for r in stuck:
        alone_since.setdefault(r, now)
    late = {r for r in stuck if now - alone_since[r] >= ALONE_S}
    if not late:
        return {}
    stacks = {r: thread_stack(threads[r]) for r in late}
    mtpg.ProcessLocalGroup.exception_handle(RuntimeError("shardcheck: an unmatched collective"))
    return {r: RankResult(r, "failed", f"rank {r} (thread) waits in a collective that no other rank will "
                                       f"join (the ones missing returned): an unmatched collective.\n"
                                       f"Its Python stack:\n{stacks[r]}", failed_at=now) for r in late}


def _run_in_world(task: Task, world_size: int, timeout: float, mtpg, world):
    """One thread per rank in the installed threaded world; stopped, if need be, at the deadline.
    Returns every rank's result and the rank threads."""
    store = BatonStore()
    answers: list[RankResult | None] = [None] * world_size
    meshes: list[dict] = [{} for _ in range(world_size)]
    baton = threading.Lock()  # this world's (see _install_baton): a rank left hung keeps only it

    def rank_thread(rank: int) -> None:
        dist.init_process_group("threaded", rank=rank, world_size=world_size, store=store)
        baton.acquire()
        _taps.baton = baton
        try:
            ctx = RankContext(rank=rank, world_size=world_size, backend="threaded",
                              device=device_for("threaded", rank), mode="thread",
                              _meshes=meshes[rank])
            settle_numerics(ctx.device)
            answers[rank] = execute(task, ctx, on_failure=mtpg.ProcessLocalGroup.exception_handle)
        finally:
            if getattr(_taps, "baton", None) is baton:
                _taps.baton = None
                baton.release()
            if dist.distributed_c10d._world is world:
                dist.destroy_process_group()

    threads = [threading.Thread(target=rank_thread, args=(r,), name=f"shardcheck-rank{r}",
                                daemon=True) for r in range(world_size)]
    os_before = os_threads()
    for t in threads:
        t.start()

    alone_since: dict[int, float] = {}  # rank -> when it was found waiting in a collective alone

    def poll(pending: set[int], wait_s: float) -> dict[int, RankResult]:
        """The ranks whose thread ended (the poll of `wait_for_ranks`), and those waiting in a
        collective that no rank can join any more (`_unmatched`)."""
        live = next((threads[r] for r in pending if threads[r].is_alive()), None)
        if live is not None:
            live.join(min(wait_s, 0.01))
        ended = {r: answers[r] if answers[r] is not None else no_result(r)
                 for r in pending if not threads[r].is_alive()}
        return ended or _unmatched(threads, pending, alone_since, mtpg)

    results, pending = wait_for_ranks(world_size, timeout, poll, task.test_id)
    for res in results.values():
        if "Test termination event" in res.message:
            res.stopped = True  # woken out of a collective by the failing rank
    finished = dict(results)  # what arrives after this point is the harness stopping ranks
    for r in pending:
        results[r] = unfinished(r, thread_stack(threads[r]), finished, timeout, label=" (thread)")
    if pending:
        mtpg.ProcessLocalGroup.exception_handle(TimeoutError("shardcheck: test stopped"))
    # A rank woken by the termination event (a failure, an unmatched collective, the deadline) is
    # still unwinding, and sets the event again on its way out: the next test must not start (the
    # caller resets the group) before it is gone, or that test's first collective is terminated.
    end = time.monotonic() + UNWIND_S
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    # ... and the OS threads they and their OpenMP teams ran on must be gone: a process forked while
    # one still runs its destructors can inherit a lock held (see wait_for_os_exit)
    wait_for_os_exit(os_before, end)
    return [results[r] for r in range(world_size)], threads
