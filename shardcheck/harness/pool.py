"""A set of rank processes that share one process group and run tests one after another.

`RankPool.run` sends a task to every rank and waits for all of them (shardcheck/harness/waiting.py), watching
three things at once: each rank's result pipe, each rank's process sentinel (it died), and the
deadline. Whatever goes wrong (a rank fails while others block in a collective, a rank dies, the
deadline passes) the ranks still pending are asked for their Python stacks, then terminated, then
killed, and the pool is marked broken so the caller starts a fresh one: the next test always runs on
clean ranks.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import shutil
import signal
import time
from multiprocessing.connection import wait

from shardcheck.harness import cuda
from shardcheck.harness.ledger import blame_unmatched
from shardcheck.harness.output import output_path, output_since, pool_dir, trim_text
from shardcheck.harness.task import RankResult, Task
from shardcheck.harness.stacks import trim_stack
from shardcheck.harness.waiting import unfinished, wait_for_ranks
from shardcheck.harness.worker import rank_main
from shardcheck.errors import ShardcheckError

START_TIMEOUT_S = 120.0
PRELOAD = ["torch", "torch.distributed", "shardcheck.harness.worker", "shardcheck.harness.task", "shardcheck.harness.context"]


def preload(modules) -> None:
    """Import `modules` now, in the parent, before ranks start: a forked rank inherits them and a
    forkserver imports them once, where otherwise every rank of every pool (a new one after each
    failed test) imports them again (ini option `rank_preload`)."""
    for name in modules:
        importlib.import_module(name)
        if name not in PRELOAD:
            PRELOAD.append(name)


def start_method(backend: str) -> str:
    """How a pool starts its ranks: fork is fastest; forkserver (with PRELOAD) for nccl, and once this
    process initialised CUDA (a forked child of it could not use CUDA: shardcheck.harness.cuda).
    SHARDCHECK_START_METHOD overrides."""
    forced = os.environ.get("SHARDCHECK_START_METHOD")
    if forced:
        return forced
    if backend == "nccl" or cuda.driver_touched():
        return "forkserver"
    return "fork"


def describe_exit(code: int | None) -> str:
    if code is None:
        return "did not exit"
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class PoolStartError(ShardcheckError, RuntimeError):
    pass


class RankDiedIdle(ShardcheckError, RuntimeError):
    """A rank died between tests (found when the next test was handed out): no body of the new
    test ran on any rank (they meet at the pool's gate first), so it can run again on fresh ranks."""

    def __init__(self, deaths: list[tuple[str | None, str]]):
        super().__init__("; ".join(message for _, message in deaths))
        self.deaths = deaths


class RankPool:
    def __init__(self, world_size: int, backend: str, method: str = "fork", mode: str = "pool",
                 pg_timeout_s: float = 1800.0, devices: list[str] | None = None):
        self.world_size, self.backend, self.method, self.mode = world_size, backend, method, mode
        self.devices = devices  # leased device ids (shardcheck.harness.devices): each rank's CUDA_VISIBLE_DEVICES
        self.owner_pid = os.getpid()
        self.broken = False
        self.tmpdir = pool_dir()
        context = mp.get_context(method)
        if method == "forkserver":
            context.set_forkserver_preload(PRELOAD)
        # Each rank's place between tests, in shared memory (no message, no cost): +n while it runs
        # the pool's n-th test, -n once it has answered it, 0 before its first test.
        self.state = context.RawArray("q", world_size)
        # Where the ranks meet before every body: in shared memory, far cheaper than a barrier of
        # the process group (`python -m shardcheck.harness.overhead_bench`; the figures: docs/speed.md, issue 29)
        self.gate = context.Barrier(world_size)
        self.seq = 0
        self.test_ids: dict[int, str] = {}  # the last tests run here, by sequence number
        self.procs, self.conns, self.stack_paths = [], [], []
        store_path = os.path.join(self.tmpdir, "store")
        for rank in range(world_size):
            parent_end, child_end = context.Pipe()
            stack_path = os.path.join(self.tmpdir, f"stacks-rank{rank}.txt")
            proc = context.Process(
                target=rank_main, name=f"shardcheck-rank{rank}", daemon=True,
                args=(rank, world_size, backend, store_path, child_end, self.owner_pid, stack_path,
                      pg_timeout_s, mode, ",".join(devices) if devices is not None else None),
                kwargs={"state": self.state, "gate": self.gate})
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
            ready = self._ready(pending, max(0.0, deadline - time.monotonic()))
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

    def _ready(self, pending: set[int], timeout: float) -> list:
        """Block at most `timeout` for a message or a death of one of the `pending` ranks."""
        return wait([self.conns[r] for r in pending] + [self.procs[r].sentinel for r in pending],
                    timeout=timeout)

    @property
    def usable(self) -> bool:
        return not self.broken and self.owner_pid == os.getpid() and all(p.is_alive() for p in self.procs)

    def _output_path(self, r: int) -> str:
        return output_path(self.stack_paths[r])

    def _idle_death(self, r: int) -> tuple[str | None, str]:
        """(the test that ran last on rank r, or None, message) for a rank that died while idle."""
        self.procs[r].join(1)
        last = self.test_ids.get(-self.state[r])
        after = f"after test {last} had passed on it" if last else "before its first test"
        return last, (f"rank {r} of the {self.backend} pool (world size {self.world_size}) "
                      f"{describe_exit(self.procs[r].exitcode)} while idle, {after}")

    def idle_deaths(self) -> list[tuple[str | None, str]]:
        """Ranks that died on their own while idle between tests (see `_idle_death`). Ranks the
        harness stopped are not listed."""
        if self.broken or self.owner_pid != os.getpid():
            return []
        return [self._idle_death(r) for r, proc in enumerate(self.procs)
                if self.state[r] <= 0 and not proc.is_alive()]

    def run(self, task: Task, timeout: float) -> list[RankResult]:
        """Run `task` on every rank; the deadline covers the body, not the pool's start-up."""
        self.seq += 1
        task.seq, self.test_ids[self.seq] = self.seq, task.test_id
        self.test_ids.pop(self.seq - 2, None)
        offsets = [os.path.getsize(p) if os.path.exists(p) else 0
                   for p in map(self._output_path, range(self.world_size))]
        for conn in self.conns:
            try:
                conn.send(task)
            except (BrokenPipeError, OSError):
                pass  # that rank is dead; its sentinel says so below
        try:
            results, pending = wait_for_ranks(self.world_size, timeout, self._poll, task.test_id)
        except BaseException:
            # Interrupted in the parent (Ctrl-C, pytest-timeout): never leave ranks running.
            self.broken = True
            self.kill()
            raise
        if pending:
            self._stop_pending(results, pending, timeout)
        self._check_alive_after(results)
        blame_unmatched(results)
        for r, res in results.items():
            res.message = trim_text(res.message)
            output = (output_since(self._output_path(r), offsets[r], f"rank{r}")
                      if res.outcome == "failed" else "")
            if output:
                res.message = f"{res.message.rstrip()}\nIts output during the test (last lines):\n{output}"
        if pending:
            self.kill()  # after reading their output: the pool's folder goes with it
        if any(res.outcome == "failed" for res in results.values()):
            # Collectives may be left half-matched: never reuse these ranks. Ranks that all
            # returned (passed or skipped) completed every collective they started, each matched
            # by the others, so they are reused.
            self.broken = True
        return [results[r] for r in range(self.world_size)]

    def _poll(self, pending: set[int], wait_s: float) -> dict[int, RankResult]:
        """The results (or deaths) of pending ranks within `wait_s` (the poll of `wait_for_ranks`)."""
        ready = self._ready(pending, wait_s)
        arrived = {}
        # deaths first: a peer's death is what makes the others raise ("Connection closed")
        for r in sorted(pending, key=lambda r: self.procs[r].sentinel not in ready):
            result = self._collect(r, ready)
            if result is not None:
                arrived[r] = result
        self._check_idle_deaths(arrived)  # at once: the others wait at the gate, they never answer
        return arrived

    def _check_idle_deaths(self, results: dict[int, RankResult]) -> None:
        """A rank that died before it took this test was idle: its death belongs to the test before,
        and no body of this one ran (the ranks meet at the gate first). Raises RankDiedIdle."""
        idle = [r for r, res in results.items() if res.died and abs(self.state[r]) != self.seq]
        if idle:
            deaths = [self._idle_death(r) for r in idle]
            self.kill()
            raise RankDiedIdle(deaths)

    def _stop_pending(self, results: dict[int, RankResult], pending: set[int], timeout: float) -> None:
        """Ranks still running past the deadline, or past the grace after a failure: their stacks."""
        self.broken = True
        stacks = self.stacks(pending)
        finished = dict(results)
        for r in pending:
            results[r] = unfinished(r, stacks[r], finished, timeout)

    def _check_alive_after(self, results: dict[int, RankResult]) -> None:
        """End-of-test check (one poll, no message): a rank that died right after answering fails
        this test, not the next one. Skipped when the test failed anyway."""
        if self.broken or any(res.outcome == "failed" for res in results.values()):
            return
        for sentinel in wait([p.sentinel for p in self.procs], timeout=0):
            r = next(i for i, p in enumerate(self.procs) if p.sentinel == sentinel)
            self.procs[r].join(1)
            results[r] = RankResult(r, "failed", f"rank {r} {describe_exit(self.procs[r].exitcode)} "
                                                 f"just after its test body returned", died=True,
                                    failed_at=time.monotonic())

    def _collect(self, r: int, ready) -> RankResult | None:
        if self.conns[r] in ready:
            try:
                return self.conns[r].recv()
            except (EOFError, OSError):
                pass  # it died mid-send; the sentinel tells how
        if self.conns[r] in ready or self.procs[r].sentinel in ready:
            self.procs[r].join(2)
            return RankResult(r, "failed", f"rank {r} {describe_exit(self.procs[r].exitcode)} "
                                           f"during the test", died=True, failed_at=time.monotonic())
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

    def shutdown(self) -> list[tuple[str | None, str]]:
        """Ask ranks to leave; kill whoever does not within a second. Returns the ranks that had
        died on their own while idle (see `idle_deaths`)."""
        if self.owner_pid != os.getpid():
            return []  # a forked copy of the owner (pytest-forked): these ranks are not ours
        deaths = self.idle_deaths()
        if not self.broken and not deaths:
            for conn in self.conns:
                try:
                    conn.send(None)
                except (OSError, BrokenPipeError):
                    pass
            for proc in self.procs:
                proc.join(1.0)
        self.kill()
        return deaths

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
