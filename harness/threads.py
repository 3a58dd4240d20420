"""Thread mode: every rank is a thread of this process, joined by torch's threaded process group.

This is the ONLY module of the project that imports `torch.testing._internal` (private, changes every
release, needs `expecttest`); keep it that way.

Threads cannot be killed: a hung rank is reported with its stack, the threaded group's terminate
event wakes ranks blocked in a collective, and a rank sleeping in Python is left behind as a daemon
thread (it dies with the process, and the next test gets a fresh threaded world).
"""

from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist

from harness.context import RankContext
from harness.devices import device_for
from harness.pool import FAILURE_GRACE_S
from harness.stacks import thread_stack
from harness.task import RankResult, Task, execute, reset_process_state

_RUN_LOCK = threading.Lock()  # one threaded world at a time per process


def _threaded_pg():
    from torch.testing._internal.distributed import multi_threaded_pg  # noqa: the isolated import

    return multi_threaded_pg


def run_threads(task: Task, world_size: int, timeout: float) -> list[RankResult]:
    mtpg = _threaded_pg()
    with _RUN_LOCK:
        reset_process_state(task.seed)
        torch._C._distributed_c10d._set_thread_isolation_mode(True)
        world = mtpg._install_threaded_pg()
        store = dist.HashStore()
        results: list[RankResult | None] = [None] * world_size
        meshes: list[dict] = [{} for _ in range(world_size)]

        def rank_thread(rank: int) -> None:
            dist.init_process_group("threaded", rank=rank, world_size=world_size, store=store)
            try:
                ctx = RankContext(rank=rank, world_size=world_size, backend="threaded",
                                  device=device_for("threaded", rank), mode="thread",
                                  _meshes=meshes[rank])
                results[rank] = execute(task, ctx, on_failure=mtpg.ProcessLocalGroup.exception_handle)
            finally:
                if dist.distributed_c10d._world is world:
                    dist.destroy_process_group()

        threads = [threading.Thread(target=rank_thread, args=(r,), name=f"shardcheck-rank{r}",
                                    daemon=True) for r in range(world_size)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout
        first_failure = None
        try:
            while any(t.is_alive() for t in threads):
                failed = [r for r, res in enumerate(results) if res and res.outcome == "failed"]
                if failed and first_failure is None:
                    first_failure = (failed[0], time.monotonic())
                now = time.monotonic()
                if now > deadline or (first_failure and now > first_failure[1] + FAILURE_GRACE_S):
                    break
                next(t for t in threads if t.is_alive()).join(0.01)
            final = list(results)  # what arrives after this point is the harness stopping ranks
            for r, t in enumerate(threads):
                if t.is_alive():
                    why = ("did not finish within the deadline (hang?)" if first_failure is None
                           else f"was still running after rank {first_failure[0]} failed; stopped")
                    final[r] = RankResult(r, "failed", f"rank {r} (thread) {why}.\n"
                                                       f"Its Python stack:\n{thread_stack(t)}",
                                          stopped=first_failure is not None)
                elif final[r] and "Test termination event" in final[r].message:
                    final[r].stopped = True  # woken out of a collective by the failing rank
            if any(t.is_alive() for t in threads):
                mtpg.ProcessLocalGroup.exception_handle(TimeoutError("shardcheck: test stopped"))
                for t in threads:
                    t.join(0.5)
        finally:
            mtpg.ProcessLocalGroup.reset()
            mtpg._uninstall_threaded_pg()
            torch._C._distributed_c10d._set_thread_isolation_mode(False)
        return [res if res is not None else RankResult(r, "failed", f"rank {r} produced no result")
                for r, res in enumerate(final)]
