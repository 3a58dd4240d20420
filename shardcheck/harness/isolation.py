"""What a test body may leave behind in a rank process that runs the next test, and what the
harness does about it.

A pool's rank processes run test after test (that is what makes the suite fast), so each test must
find the process as the first one did. After every body, on every rank:

* **restored** (`Settings`): settings a test may legitimately change and that can be set back
  exactly: the environment, the working directory, `sys.path`, warning filters, torch's default
  dtype and device, grad and anomaly modes, deterministic algorithms, float32 matmul precision,
  the number of intra-op threads. (The RNG states are reseeded before every body, shardcheck.harness.task.)
* **refused** (`leftovers`, `unmatched`): what cannot be undone from outside and would change
  the next test. The test that left it fails with one line saying what, and its ranks are retired
  (the next test starts on fresh ones): a thread or child process it started that is still
  running, a regular file it opened and left open, a pending timer (signal.alarm), a function of
  torch.distributed or torch.nn.functional replaced (a monkeypatch left behind), inference mode
  left on, the default process group destroyed or
  replaced, and collectives that were not issued on every rank of their group.

Unmatched collectives are found by counting, not by waiting (shardcheck.harness.ledger): each rank hands the
parent its count of collectives per group, and the parent compares them.

Not covered (no generic way back): a monkeypatch of any other module, a module imported, state
inside a C library. A test that needs such changes runs in fresh processes (`--shardcheck-launch spawn`).
"""

from __future__ import annotations

import os
import signal
import stat
import sys
import threading
import time
import types
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from shardcheck.harness.ledger import CollectiveLedger

THREAD_GRACE_S = 0.2  # how long threads a body started get to end after it returned
# Modules whose functions a test may monkeypatch and forget (a collective wrapped for counting, say):
# a replaced function is refused, since no generic undo exists.
WATCHED_MODULES = ("torch.distributed", "torch.distributed.distributed_c10d", "torch.nn.functional")



@dataclass
class Settings:
    """The process-wide settings a body may change, as they were when captured."""

    environ: dict  # bytes -> bytes, as os.environ keeps it (`_environ_data`)
    cwd: str
    sys_path: list[str]
    warning_filters: list
    default_dtype: torch.dtype
    default_device: torch.device
    grad_enabled: bool
    anomaly: tuple[bool, bool]
    deterministic: tuple[bool, bool]
    matmul_precision: str
    num_threads: int

    @classmethod
    def capture(cls) -> "Settings":
        return cls(_environ_data(), os.getcwd(), list(sys.path), list(warnings.filters),
                   torch.get_default_dtype(), torch.get_default_device(), torch.is_grad_enabled(),
                   (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
                   (torch.are_deterministic_algorithms_enabled(),
                    torch.is_deterministic_algorithms_warn_only_enabled()),
                   torch.get_float32_matmul_precision(), torch.get_num_threads())

    def restore(self) -> None:
        """Set every setting back to its captured value (each one only when it changed)."""
        if getattr(os.environ, "_data", None) != self.environ and _environ_data() != self.environ:
            os.environ.clear()
            os.environ.update({os.fsdecode(k): os.fsdecode(v) for k, v in self.environ.items()})
        if os.getcwd() != self.cwd:
            os.chdir(self.cwd)
        if sys.path != self.sys_path:
            sys.path[:] = self.sys_path
        if warnings.filters != self.warning_filters:
            warnings.filters[:] = self.warning_filters
            getattr(warnings, "_filters_mutated", lambda: None)()  # its cache, as resetwarnings does
        if torch.get_default_dtype() != self.default_dtype:
            torch.set_default_dtype(self.default_dtype)
        if torch.get_default_device() != self.default_device:
            torch.set_default_device(self.default_device)
        torch.set_grad_enabled(self.grad_enabled)
        if (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()) != self.anomaly:
            torch.set_anomaly_enabled(*self.anomaly)
        if (torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled()) != self.deterministic:
            torch.use_deterministic_algorithms(self.deterministic[0], warn_only=self.deterministic[1])
        if torch.get_float32_matmul_precision() != self.matmul_precision:
            torch.set_float32_matmul_precision(self.matmul_precision)
        torch.set_num_threads(self.num_threads)  # always: another thread's setting reads the same here


def _environ_data() -> dict:
    """The environment as a plain dict, cheaply: os.environ's own bytes mapping where CPython has one
    (a comparison then decodes no entry)."""
    data = getattr(os.environ, "_data", None)
    return dict(data) if isinstance(data, dict) else {k.encode(): v.encode() for k, v in os.environ.items()}


def _descriptors() -> set[int]:
    """The file descriptors this process holds (Linux; empty elsewhere)."""
    try:
        return {int(name) for name in os.listdir("/proc/self/fd")}
    except OSError:
        return set()


def _is_open(fd: int) -> bool:
    """False for the descriptor that listed /proc/self/fd, closed once the listing was read."""
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def _lowest_free(held: set[int]) -> int:
    return next(fd for fd in range(len(held) + 1) if fd not in held)


def _open_files(known: set[int]) -> dict[int, str]:
    """{fd: path} of the regular files this process holds open among the descriptors not in `known`:
    not sockets, pipes or devices (the process group's and the harness's own), nor another handle on
    the process's own stdout or stderr (a library's log handler opens /dev/stdout once and keeps it)."""
    found, outputs = {}, set()
    for std in (1, 2):
        try:
            st = os.fstat(std)
            outputs.add((st.st_dev, st.st_ino))
        except OSError:
            pass
    for fd in _descriptors() - known:
        try:
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) not in outputs:
                found[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass  # the listing's own descriptor, closed since
    return found


def _children() -> set[int]:
    """The pids of the child processes (running, or ended and not waited for) this process's main
    thread started (Linux; empty elsewhere). A body runs on the main thread; a child started from a
    thread it left running is refused as that thread. A process with no child at all is told in a
    system call (waitid, reaping nothing), before /proc is read."""
    try:
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return set()
    except (AttributeError, OSError):
        pass  # no waitid here: ask /proc
    try:
        with open(f"/proc/self/task/{os.getpid()}/children") as f:
            return {int(pid) for pid in f.read().split()}
    except OSError:
        return set()


_UNSET = object()


class WatchedModule(types.ModuleType):
    """A watched module's class (WATCHED_MODULES): it keeps, for each attribute assigned from outside
    the module (a monkeypatch: `setattr`, `mock.patch`), the object it was bound to before the first
    such assignment since the baseline (`Baseline.take`), so that finding one left behind costs
    nothing per test. The module's own global assignments do not pass here, and need not."""

    originals: dict[tuple[str, str], Any] = {}  # (module, attribute) -> its object at the baseline

    def __setattr__(self, attr, value):
        WatchedModule.originals.setdefault((self.__name__, attr), vars(self).get(attr, _UNSET))
        super().__setattr__(attr, value)


def _watch(module) -> None:
    """Watch `module`: its class becomes WatchedModule (once)."""
    if type(module) is types.ModuleType:
        module.__class__ = WatchedModule


@dataclass
class Baseline:
    """What the process held before its first test: its threads, file descriptors, child processes
    and default process group. The same holds before every later test, since a test that leaves
    anything more is refused and its ranks retired."""

    threads: set = field(default_factory=set)  # threading.Thread objects
    fds: set[int] = field(default_factory=set)
    children: set[int] = field(default_factory=set)
    default_group: Any = None
    lowest_free: int = -1

    @classmethod
    def take(cls) -> "Baseline":
        held = {fd for fd in _descriptors() if _is_open(fd)}
        for name in WATCHED_MODULES:
            if name in sys.modules:
                _watch(sys.modules[name])
        WatchedModule.originals.clear()  # what the modules hold now is the baseline
        return cls(set(threading.enumerate()), held, _children(),
                   dist.group.WORLD if dist.is_initialized() else None, _lowest_free(held))

    @staticmethod
    def replaced() -> list[str]:
        """The public functions and classes of WATCHED_MODULES bound to another object now than at
        the baseline (a monkeypatch left behind; one undone within the test is not)."""
        return sorted(f"{name}.{attr}" for (name, attr), was in WatchedModule.originals.items()
                      if not attr.startswith("_") and callable(was) and vars(sys.modules[name]).get(attr) is not was)

    def new_files(self) -> dict[int, str]:
        """{fd: path} of the regular files opened since. A descriptor opened and left open takes the
        lowest free number, so while that one is still free nothing was left open (one system call).
        Descriptors that are not files (the process group's sockets, opened on first use of a
        sub-group) join the baseline. A file counts only if it stays open for THREAD_GRACE_S: another
        thread of the process may hold one for a moment (glibc's malloc reads
        /proc/sys/vm/overcommit_memory once per process, from whichever thread frees first; with
        ranks as threads under load that failed a test that opened nothing)."""
        if not _is_open(self.lowest_free):
            return {}
        files = _open_files(known=self.fds)
        end = time.monotonic() + THREAD_GRACE_S
        while files and time.monotonic() < end:  # what stays open through THREAD_GRACE_S
            time.sleep(0.01)
            files = {fd: path for fd, path in _open_files(known=self.fds).items() if files.get(fd) == path}
        self.fds |= {fd for fd in _descriptors() if fd not in files and _is_open(fd)}
        self.lowest_free = _lowest_free(self.fds)
        return files


def leftovers(before: Baseline, ignore_threads=()) -> list[str]:
    """What the body left that the next test would inherit, one phrase each (empty: nothing).
    Threads it started get THREAD_GRACE_S to end; `ignore_threads` are the harness's own."""
    # Thread objects, not idents: a thread that ended (a rank thread) can hand its ident to a new one
    started = [t for t in threading.enumerate() if t not in before.threads and t not in ignore_threads]
    end = time.monotonic() + THREAD_GRACE_S
    for t in started:
        t.join(max(0.0, end - time.monotonic()))
    found = []
    alive = [t for t in started if t.is_alive()]
    if alive:
        names = ", ".join(f"{t.name!r}{' (daemon)' if t.daemon else ''}" for t in alive)
        found.append(f"{len(alive)} thread{'s' if len(alive) > 1 else ''} still running ({names}): "
                     f"join it before the test returns")
    files = before.new_files()
    if files:
        names = ", ".join(f"{path} (fd {fd})" for fd, path in sorted(files.items()))
        found.append(f"{len(files)} file{'s' if len(files) > 1 else ''} open ({names}): close it")
    children = _children() - before.children
    if children:
        found.append(f"{len(children)} child process{'es' if len(children) > 1 else ''} still running "
                     f"(pid {', '.join(map(str, sorted(children)))}): wait for it")
    if hasattr(signal, "getitimer") and signal.getitimer(signal.ITIMER_REAL)[0] > 0:
        found.append("a timer pending (signal.alarm or setitimer): cancel it")
    replaced = before.replaced()
    if replaced:
        found.append(f"{', '.join(replaced)} replaced (a module-level monkeypatch): restore "
                     f"{'them' if len(replaced) > 1 else 'it'} before returning (unittest.mock.patch as a "
                     f"context manager does), or run such a test in fresh processes (--shardcheck-launch spawn)")
    if torch.is_inference_mode_enabled():
        found.append("inference mode on: leave torch.inference_mode() before returning")
    if before.default_group is not None and (not dist.is_initialized() or dist.group.WORLD is not before.default_group):
        found.append("the default process group destroyed or replaced: the harness owns it")
    return found


def refuse(result, left: list[str]) -> None:
    """Fail a rank's `result` that has not failed already for the `leftovers` it names. No failure
    time: ranks that each left something are not one another's consequences."""
    if left and result.outcome != "failed":
        result.outcome, result.refused = "failed", True
        result.message = ("test left " + "; ".join(left) +
                          " (the next test would inherit it; these ranks are retired)")


def settle(result, before: Baseline, ledger: CollectiveLedger | None) -> None:
    """After a body, on its rank: fail it for what it left behind and hand the parent this rank's
    collective counts (compared across ranks by `unmatched`). The settings are set back after the
    result is sent (`Settings.restore`): the verdict does not wait for it."""
    left = leftovers(before)
    pending = ledger.outstanding(THREAD_GRACE_S) if ledger is not None else []
    if pending:
        left.append(f"{len(pending)} collective{'s' if len(pending) > 1 else ''} outstanding "
                    f"({', '.join(pending)} with async_op=True, not completed): wait() on the work "
                    f"before returning")
    refuse(result, left)
    if ledger is not None:
        result.collectives = {"counts": ledger.counts(), "issued": ledger.take_issued()}
