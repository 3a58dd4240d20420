"""A set of rank processes that share one process group and run tests one after another.

`RankPool.run` sends a task to every rank and waits for all of them, watching three things at once:
each rank's result pipe, each rank's process sentinel (it died), and the deadline. Whatever goes wrong
(a rank fails while others block in a collective, a rank dies, the deadline passes) the ranks still
pending are asked for their Python stacks, then terminated, then killed, and the pool is marked broken
so the caller starts a fresh one: the next test always runs on clean ranks.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import time
from multiprocessing.connection import wait

from harness.task import RankResult, Task
from harness.verdict import trim_stack
from harness.worker import rank_main

FAILURE_GRACE_S = 1.0  # after one rank fails, how long the others get to report before they are stopped
START_TIMEOUT_S = 120.0
PRELOAD = ["torch", "torch.distributed", "harness.worker", "harness.task", "harness.context"]


def describe_exit(code: int | None) -> str:
    if code is None:
        return "did not exit"
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class PoolStartError(RuntimeError):
    pass


class RankPool:
    def __init__(self, world_size: int, backend: str, method: str = "fork", mode: str = "pool",
                 pg_timeout_s: float = 1800.0, devices: list[str] | None = None):
        self.world_size, self.backend, self.method, self.mode = world_size, backend, method, mode
        self.devices = devices  # leased device ids (harness.devices): each rank's CUDA_VISIBLE_DEVICES
        self.owner_pid = os.getpid()
        self.broken = False
        self.tmpdir = tempfile.mkdtemp(prefix="shardcheck-pool-")
        context = mp.get_context(method)
        if method == "forkserver":
            context.set_forkserver_preload(PRELOAD)
        self.procs, self.conns, self.stack_paths = [], [], []
        store_path = os.path.join(self.tmpdir, "store")
        for rank in range(world_size):
            parent_end, child_end = context.Pipe()
            stack_path = os.path.join(self.tmpdir, f"stacks-rank{rank}.txt")
            proc = context.Process(
                target=rank_main, name=f"shardcheck-rank{rank}", daemon=True,
                args=(rank, world_size, backend, store_path, child_end, self.owner_pid, stack_path,
                      pg_timeout_s, mode, ",".join(devices) if devices is not None else None))
            proc.start()
            child_end.close()
            self.procs.append(proc)
            self.conns.append(parent_end)
            self.stack_paths.append(stack_path)
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        pending = set(range(self.world_size))
        while pending:
            ready = wait([self.conns[r] for r in pending] + [self.procs[r].sentinel for r in pending],
                         timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                self.kill()
                raise PoolStartError(f"ranks {sorted(pending)} did not join the {self.backend} process "
                                     f"group within {START_TIMEOUT_S:.0f} s")
            for r in list(pending):
                if self.conns[r] in ready:
                    try:
                        self.conns[r].recv()
                    except EOFError:
                        pass
                    pending.discard(r)
                elif self.procs[r].sentinel in ready:
                    self.procs[r].join(1)
                    code = self.procs[r].exitcode
                    self.kill()
                    raise PoolStartError(f"rank {r} {describe_exit(code)} while starting the "
                                         f"{self.backend} process group")

    @property
    def usable(self) -> bool:
        return not self.broken and self.owner_pid == os.getpid() and all(p.is_alive() for p in self.procs)

    def _output_path(self, r: int) -> str:
        return self.stack_paths[r].replace("stacks-", "output-")

    def _output_since(self, r: int, offset: int, lines: int = 40) -> str:
        """What rank r printed since `offset`, minus the harness's own frames in fatal-signal dumps."""
        try:
            with open(self._output_path(r), errors="replace") as f:
                f.seek(offset)
                text = f.read()
        except OSError:
            return ""
        kept, below_body = [], False
        for line in text.splitlines():
            if line.startswith("  File "):
                below_body = below_body or "/harness/task.py" in line
                if below_body:
                    continue
            else:
                below_body = False
            if not line.startswith("Extension modules:"):
                kept.append(line)
        return "\n".join(kept[-lines:]).rstrip()

    def run(self, task: Task, timeout: float) -> list[RankResult]:
        offsets = [os.path.getsize(p) if os.path.exists(p) else 0
                   for p in map(self._output_path, range(self.world_size))]
        for conn in self.conns:
            conn.send(task)
        results: dict[int, RankResult] = {}
        pending = set(range(self.world_size))
        deadline = time.monotonic() + timeout
        stop_at = deadline
        first_failure: int | None = None
        try:
            while pending:
                ready = wait([self.conns[r] for r in pending] + [self.procs[r].sentinel for r in pending],
                             timeout=max(0.0, stop_at - time.monotonic()))
                if not ready:
                    break
                for r in sorted(pending):
                    result = self._collect(r, ready)
                    if result is None:
                        continue
                    results[r] = result
                    pending.discard(r)
                    if result.outcome == "failed" and first_failure is None:
                        first_failure = r
                        stop_at = min(deadline, time.monotonic() + FAILURE_GRACE_S)
        except BaseException:
            # Interrupted in the parent (Ctrl-C, pytest-timeout): never leave ranks running.
            self.broken = True
            self.kill()
            raise
        if pending:
            self.broken = True
            stacks = self.stacks(pending)
            if first_failure is None:
                why = f"did not finish within the {timeout:g} s deadline (hang?)"
            else:
                why = f"was still running {FAILURE_GRACE_S:g} s after rank {first_failure} failed; stopped"
            for r in pending:
                results[r] = RankResult(r, "failed", f"rank {r} {why}.\nIts Python stack:\n{stacks[r]}",
                                        stopped=first_failure is not None)
        for r, res in results.items():
            output = self._output_since(r, offsets[r]) if res.outcome == "failed" else ""
            if output:
                res.message = f"{res.message.rstrip()}\nIts output during the test (last lines):\n{output}"
        if pending:
            self.kill()
        if any(res.outcome != "passed" for res in results.values()):
            self.broken = True  # collectives may be left half-matched: never reuse these ranks
        return [results[r] for r in range(self.world_size)]

    def _collect(self, r: int, ready) -> RankResult | None:
        if self.conns[r] in ready:
            try:
                return self.conns[r].recv()
            except (EOFError, OSError):
                pass  # it died mid-send; the sentinel tells how
        if self.conns[r] in ready or self.procs[r].sentinel in ready:
            self.procs[r].join(2)
            return RankResult(r, "failed", f"rank {r} {describe_exit(self.procs[r].exitcode)} "
                                           f"during the test")
        return None

    def stacks(self, ranks) -> dict[int, str]:
        """Every listed rank's Python stacks, written by faulthandler on SIGUSR1."""
        for r in ranks:
            try:
                os.truncate(self.stack_paths[r], 0)
                os.kill(self.procs[r].pid, signal.SIGUSR1)
            except (OSError, ProcessLookupError):
                pass
        time.sleep(0.3)
        out = {}
        for r in ranks:
            try:
                with open(self.stack_paths[r]) as f:
                    out[r] = trim_stack(f.read()) or "(no stack written: the rank is stuck outside Python)"
            except OSError:
                out[r] = "(no stack file)"
        return out

    def shutdown(self) -> None:
        """Ask ranks to leave; kill whoever does not within a second."""
        if self.owner_pid != os.getpid():
            return  # a forked copy of the owner (pytest-forked): these ranks are not ours
        if not self.broken:
            for conn in self.conns:
                try:
                    conn.send(None)
                except (OSError, BrokenPipeError):
                    pass
            for proc in self.procs:
                proc.join(1.0)
        self.kill()

    def kill(self) -> None:
        if self.owner_pid != os.getpid():
            return
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
        end = time.monotonic() + 1.0
        for proc in self.procs:
            proc.join(max(0.0, end - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in self.conns:
            conn.close()
        shutil.rmtree(self.tmpdir, ignore_errors=True)
        self.broken = True
