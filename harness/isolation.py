"""What a test body may leave behind in a rank process that runs the next test, and what the
harness does about it.

A pool's rank processes run test after test (that is what makes the suite fast), so each test must
find the process as the first one did. After every body, on every rank:

* **restored** (`Settings`): settings a test may legitimately change and that can be set back
  exactly: the environment, the working directory, `sys.path`, warning filters, torch's default
  dtype and device, grad and anomaly modes, deterministic algorithms, float32 matmul precision,
  the number of intra-op threads. (The RNG states are reseeded before every body, harness.task.)
* **refused** (`leftovers`, `unmatched`): what cannot be undone from outside and would change
  the next test. The test that left it fails with one line saying what, and its ranks are retired
  (the next test starts on fresh ones): a thread or child process it started that is still
  running, a regular file it opened and left open, a pending timer (signal.alarm), inference mode
  left on, the default process group destroyed or
  replaced, and collectives that were not issued on every rank of their group.

Unmatched collectives are found by counting, not by waiting: every rank reports how many
collectives it issued on each of its process groups (the group's own sequence number, which every
collective and point-to-point operation advances, less the point-to-point operations it issued,
counted at `ProcessGroup.send`/`recv`). Counts that differ between the ranks of one group mean a
collective that some rank is still waiting on, or that the next test's first collective would be
matched against; the test that returned fails at once.

Not covered (no generic way back): a module-level monkeypatch, a module imported, state inside a C
library. A test that needs such changes runs in fresh processes (`--shardcheck-launch spawn`).
"""

from __future__ import annotations

import collections
import functools
import inspect
import os
import signal
import stat
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

THREAD_GRACE_S = 0.2  # how long threads a body started get to end after it returned

# The Python collective API, by the name a message shows (the outermost call only: all_gather_object
# is one call, not the all_gathers inside it).
COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_gather_single",
    "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "broadcast",
    "broadcast_object_list", "reduce", "gather", "gather_object", "scatter", "scatter_object_list",
    "all_to_all", "all_to_all_single", "barrier", "monitored_barrier",
)


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
    (a comparison then takes 1 us, not the 17 us of decoding every entry)."""
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


@dataclass
class Baseline:
    """What the process held before its first test: its threads, file descriptors, child processes
    and default process group. The same holds before every later test, since a test that leaves
    anything more is refused and its ranks retired."""

    threads: set[int] = field(default_factory=set)
    fds: set[int] = field(default_factory=set)
    children: set[int] = field(default_factory=set)
    default_group: Any = None
    lowest_free: int = -1

    @classmethod
    def take(cls) -> "Baseline":
        held = {fd for fd in _descriptors() if _is_open(fd)}
        return cls({t.ident for t in threading.enumerate()}, held, _children(),
                   dist.group.WORLD if dist.is_initialized() else None, _lowest_free(held))

    def new_files(self) -> dict[int, str]:
        """{fd: path} of the regular files opened since. A descriptor opened and left open takes the
        lowest free number, so while that one is still free nothing was left open (one system call).
        Descriptors that are not files (the process group's sockets, opened on first use of a
        sub-group) join the baseline."""
        if not _is_open(self.lowest_free):
            return {}
        files = _open_files(known=self.fds)
        self.fds |= {fd for fd in _descriptors() if fd not in files and _is_open(fd)}
        self.lowest_free = _lowest_free(self.fds)
        return files


def leftovers(before: Baseline, ignore_threads=()) -> list[str]:
    """What the body left that the next test would inherit, one phrase each (empty: nothing).
    Threads it started get THREAD_GRACE_S to end; `ignore_threads` are the harness's own."""
    ignored = {t.ident for t in ignore_threads}
    started = [t for t in threading.enumerate() if t.ident not in before.threads and t.ident not in ignored]
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
    if torch.is_inference_mode_enabled():
        found.append("inference mode on: leave torch.inference_mode() before returning")
    if before.default_group is not None and (not dist.is_initialized() or dist.group.WORLD is not before.default_group):
        found.append("the default process group destroyed or replaced: the harness owns it")
    return found


def refuse(result, left: list[str]) -> None:
    """Fail a rank's `result` that has not failed already for the `leftovers` it names. No failure
    time: ranks that each left something are not one another's consequences."""
    if left and result.outcome != "failed":
        result.outcome = "failed"
        result.message = ("test left " + "; ".join(left) +
                          " (the next test would inherit it; these ranks are retired)")


def settle(result, before: Baseline, settings: Settings, ledger: "CollectiveLedger | None") -> None:
    """After a body, on its rank: fail it for what it left behind, hand the parent this rank's
    collective counts (compared across ranks by `unmatched`), and set the settings back."""
    refuse(result, leftovers(before))
    if ledger is not None:
        result.collectives = {"counts": ledger.counts(), "issued": ledger.take_issued()}
    settings.restore()


# -- collectives ---------------------------------------------------------------------------------

class CollectiveLedger:
    """Counts, on this rank, the collectives issued on each process group (see the module doc).

    `counts()` is {group: collectives issued since the process started}, the group named by its
    name and ranks; `issued` names them by kind, for this test only (the Python API's calls; a
    collective issued below it, such as a functional collective, is counted but has no name)."""

    def __init__(self) -> None:
        self.p2p: collections.Counter = collections.Counter()
        self.issued: collections.Counter = collections.Counter()
        self._depth = threading.local()
        self._ranks: dict[Any, str] = {}
        self._install()

    def _key(self, group) -> str:
        if group not in self._ranks:
            ranks = ", ".join(map(str, dist.get_process_group_ranks(group)))
            self._ranks[group] = f"{group.group_name} (ranks {ranks})"
        return self._ranks[group]

    def _install(self) -> None:
        process_group = torch._C._distributed_c10d.ProcessGroup
        for method in ("send", "recv", "recv_anysource"):
            setattr(process_group, method, self._counting_p2p(getattr(process_group, method)))
        c10d = dist.distributed_c10d
        for name in COLLECTIVES:
            if hasattr(c10d, name):
                wrapped = self._naming(name, getattr(c10d, name))
                setattr(c10d, name, wrapped)
                if getattr(dist, name, None) is not None:
                    setattr(dist, name, wrapped)

    def _counting_p2p(self, method):
        def p2p(group, *args, **kwargs):
            self.p2p[self._key(group)] += 1
            return method(group, *args, **kwargs)
        return p2p

    def _naming(self, name: str, fn):
        params = list(inspect.signature(fn).parameters)
        at = params.index("group") if "group" in params else None

        @functools.wraps(fn)
        def collective(*args, **kwargs):
            if not getattr(self._depth, "n", 0):  # the outermost call names the collective
                group = kwargs.get("group", args[at] if at is not None and len(args) > at else None)
                group = dist.group.WORLD if group is None else group
                if isinstance(group, torch._C._distributed_c10d.ProcessGroup):
                    self.issued[(self._key(group), name)] += 1
            self._depth.n = getattr(self._depth, "n", 0) + 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth.n -= 1
        return collective

    def counts(self) -> dict[str, int]:
        """{group: collectives issued on it by this rank so far}, for every group it belongs to."""
        world = getattr(dist.distributed_c10d, "_world", None)
        out = {}
        for group in list(getattr(world, "pg_map", {})):
            try:
                sequence = group._get_sequence_number_for_group()
            except (RuntimeError, AttributeError):
                continue  # a backend without sequence numbers (threaded, fake): not counted
            key = self._key(group)
            out[key] = sequence - self.p2p[key]
        return out

    def take_issued(self) -> dict[str, dict[str, int]]:
        """{group: {kind: calls}} since the last call."""
        out: dict[str, dict[str, int]] = {}
        for (group, kind), n in self.issued.items():
            out.setdefault(group, {})[kind] = n
        self.issued.clear()
        return out


def unmatched(collectives: dict[int, dict]) -> dict[int, str]:
    """{rank: why it fails} for the ranks that issued more collectives on a group than another of
    its ranks. `collectives`: {rank: {"counts": CollectiveLedger.counts(), "issued": take_issued()}}."""
    by_group: dict[str, dict[int, int]] = {}
    for rank, seen in collectives.items():
        for group, count in seen["counts"].items():
            by_group.setdefault(group, {})[rank] = count
    blamed: dict[int, list[str]] = {}
    for group, counts in by_group.items():
        fewest = min(counts.values())
        behind = sorted(r for r, n in counts.items() if n == fewest)
        for rank, count in counts.items():
            if count > fewest:
                extra = count - fewest
                kinds = _difference(collectives, group, rank, behind[0])
                blamed.setdefault(rank, []).append(
                    f"{extra} unmatched collective{'s' if extra > 1 else ''} on group {group} "
                    f"({kinds or 'issued below the Python API'} on rank {rank}, not on rank"
                    f"{'s' if len(behind) > 1 else ''} {', '.join(map(str, behind))})")
    return {rank: "test left " + "; ".join(parts) for rank, parts in blamed.items()}


def blame_unmatched(results: dict) -> None:
    """Fail, in `results` ({rank: RankResult}), the ranks that left unmatched collectives, when
    every rank returned without failing (otherwise the ranks are retired anyway)."""
    if any(res.outcome == "failed" for res in results.values()):
        return
    counted = {r: res.collectives for r, res in results.items() if res.collectives is not None}
    for rank, why in unmatched(counted).items():
        results[rank].outcome = "failed"
        results[rank].message = f"{why} (the next test's collectives would be matched against it)"


def _difference(collectives: dict[int, dict], group: str, more: int, fewer: int) -> str:
    """The kinds `more` issued on `group` beyond those `fewer` did, e.g. "all_reduce x2"."""
    mine = collections.Counter(collectives[more]["issued"].get(group, {}))
    mine.subtract(collectives[fewer]["issued"].get(group, {}))
    return ", ".join(kind if n == 1 else f"{kind} x{n}" for kind, n in sorted(mine.items()) if n > 0)
