"""Simulated ranks, each in a forked process of its own, several at a time.

A simulated rank keeps process-global state (the fake default group; DeepSpeed's groups,
Megatron-FSDP's buffers) that the next rank's world must not inherit, and its memory must go back
when it ends: so each runs in a child forked for it alone. The children are independent, so they
run side by side: as many at a time as this process may use CPUs, and no more than the machine's
available memory holds at ``bytes_per_rank`` each (the caller's estimate: a rank's largest
resident set is measured, not known, before it runs).
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time
import traceback
from multiprocessing.connection import wait
from typing import Any, Callable, Sequence

from shardcheck.harness import collector
from shardcheck.harness.devices import usable_cpus
from shardcheck.harness.worker import die_with
from shardcheck.errors import ShardcheckError


class RankProcessDied(ShardcheckError, RuntimeError):
    """A simulated rank's process ended without a result (killed, out of memory, a C++ abort)."""


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), else None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def parallel_jobs(calls: int, bytes_per_rank: int) -> int:
    """How many ranks run at once: ``min(calls, CPUs, available memory // bytes_per_rank)``, at least 1."""
    cpus = usable_cpus()
    memory = available_memory_bytes()
    by_memory = memory // max(bytes_per_rank, 1) if memory is not None else 1
    return max(1, min(calls, cpus, by_memory))


def _child(send, owner: int, threads: int | None, fn: Callable, args: tuple) -> None:
    die_with(owner)  # the command killed (SIGTERM, a timeout) leaves no simulated rank running
    collector.freeze_the_long_lived()  # what the parent made stays alive here
    if threads is not None:  # the CPUs shared among the children running at once, not each all of them
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(threads)
        else:
            os.environ["OMP_NUM_THREADS"] = str(threads)  # read when torch is imported
    try:
        result = fn(*args)
    except BaseException as exc:  # noqa: BLE001 -- it travels to the parent, which decides
        exc.__notes__ = [*getattr(exc, "__notes__", []), traceback.format_exc()]
        result = exc
    try:
        send.send(result)
    except Exception as exc:  # an unpicklable result or exception: say what it was
        send.send(RuntimeError(f"{type(exc).__name__}: {exc}: {result!r}"[:2000]))
    send.close()


def _exit(code: int | None) -> str:
    """``-9`` -> "SIGKILL (the out-of-memory killer, or a kill)"; ``-6`` -> "SIGABRT"; ``70`` -> "exit code 70"."""
    if code is not None and code < 0:
        name = signal.Signals(-code).name
        return f"{name} (the out-of-memory killer, or a kill)" if name == "SIGKILL" else name
    return f"exit code {code}"


def each_in_own_process(fn: Callable, calls: Sequence[tuple], jobs: int,
                        on_done: Callable[[int, Any, float], None] | None = None) -> list[Any]:
    """``[fn(*args) for args in calls]``, each call in a forked child, ``jobs`` children at a time.
    A call that raised gives its exception in its place (with the child's traceback in
    ``__notes__``); one whose process died without answering gives :class:`RankProcessDied`.
    ``on_done(index, result, seconds)`` hears of each call as it ends (progress on long runs)."""
    context = multiprocessing.get_context("fork")
    jobs = max(jobs, 1)
    threads = max(1, usable_cpus() // jobs) if jobs > 1 else None
    results: list[Any] = [None] * len(calls)
    waiting = list(enumerate(calls))
    running: dict = {}  # receiving end -> (index, process, when it started)
    try:
        while waiting or running:
            while waiting and len(running) < jobs:
                index, args = waiting.pop(0)
                receive, send = context.Pipe(duplex=False)
                process = context.Process(target=_child, args=(send, os.getpid(), threads, fn, args))
                process.start()
                send.close()
                running[receive] = (index, process, time.perf_counter())
            for receive in wait(list(running)):
                index, process, started = running.pop(receive)
                try:
                    results[index] = receive.recv()
                except EOFError:
                    process.join()
                    results[index] = RankProcessDied(f"its process ended with {_exit(process.exitcode)} and no result")
                except Exception as exc:  # sent, but not readable here (an exception that does not unpickle)
                    results[index] = RuntimeError(f"its result could not be read: {type(exc).__name__}: {exc}")
                receive.close()
                process.join()
                if on_done is not None:
                    on_done(index, results[index], time.perf_counter() - started)
    finally:  # interrupted (Ctrl-C) or failed here: no simulated rank outlives the command
        for receive, (_, process, _) in running.items():
            process.kill()
            process.join()
            receive.close()
    return results


def progress(ranks: Sequence[int]) -> Callable[[int, Any, float], None]:
    """An ``on_done`` that says on stderr which simulated rank ended, how, and how many are left."""
    done = []

    def on_done(index: int, result: Any, seconds: float) -> None:
        done.append(index)
        how = f"could not run ({type(result).__name__})" if isinstance(result, BaseException) else "done"
        print(f"shardcheck simulate: rank {ranks[index]} {how} in {seconds:.1f} s ({len(done)} of {len(ranks)})",
              file=sys.stderr, flush=True)

    return on_done
