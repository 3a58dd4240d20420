"""Waiting for every rank's result: the one loop of the pool, thread and external modes, and what a
rank that never answered is reported as.

`wait_for_ranks` stops when every rank has answered, when the deadline passes, or FAILURE_GRACE_S
after the first failure (the other ranks get that long to report: blocked in a collective with the
failed rank, they never would). Each mode brings its `poll`, which blocks at most the time it is
given and returns the results that arrived: the pool waits on its pipes and process sentinels, the
thread mode joins its threads, the external mode exchanges every rank's result at once.

A wait longer than OVERDUE_S (or a quarter of the deadline, if that is shorter) is announced where $SHARDCHECK_WAITING_DIR names a folder (`shardcheck
run` sets it; its progress line shows the notices): one JSON file per waiting process, rewritten
every NOTICE_EVERY_S with the test, the ranks not answered yet, the seconds waited and the deadline,
and removed when the wait ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Callable

from shardcheck.harness.task import RankResult
from shardcheck.harness.verdict import root_first

FAILURE_GRACE_S = 1.0  # after one rank fails, how long the others get to report before they are stopped
OVERDUE_S = 10.0  # a wait this long is announced: some 5x a conformance cell's usual time
NOTICE_EVERY_S = 1.0
WAITING_DIR_ENV = "SHARDCHECK_WAITING_DIR"

# poll(pending ranks, seconds it may block) -> {rank: result} of the ranks that answered meanwhile
Poll = Callable[[set[int], float], dict[int, RankResult]]


def wait_for_ranks(world_size: int, timeout: float, poll: Poll,
                   test_id: str = "") -> tuple[dict[int, RankResult], set[int]]:
    """Every rank's result, or as many as came before the deadline or the grace after a failure;
    returns (results by rank, ranks still pending). A long wait is announced (module doc)."""
    results: dict[int, RankResult] = {}
    pending = set(range(world_size))
    started = time.monotonic()
    overdue_s = min(OVERDUE_S, timeout / 4)
    deadline = started + timeout
    stop_at = deadline
    with _notices(test_id, world_size, timeout) as announce:
        while pending:
            now = time.monotonic()
            waited = now - started
            wake = stop_at
            if announce is not None:
                if waited >= overdue_s:
                    announce(pending, waited)
                wake = min(wake, started + overdue_s if waited < overdue_s else now + NOTICE_EVERY_S)
            arrived = poll(pending, max(0.0, wake - now))
            if not arrived and time.monotonic() >= stop_at:
                break
            for r, result in arrived.items():
                results[r] = result
                pending.discard(r)
                if result.outcome == "failed" and stop_at == deadline:
                    stop_at = min(deadline, time.monotonic() + FAILURE_GRACE_S)
    return results, pending


@contextlib.contextmanager
def _notices(test_id: str, world_size: int, timeout: float):
    """announce(pending ranks, seconds waited) -> this process's notice file, when the folder is
    set (else None is yielded); the file is gone when the wait ends, however it ends."""
    folder = os.environ.get(WAITING_DIR_ENV)
    if not folder:
        yield None
        return
    path = Path(folder) / f"{os.getpid()}.json"

    def announce(pending: set[int], waited_s: float) -> None:
        notice = {"test": test_id, "pending": sorted(pending), "world_size": world_size,
                  "waited_s": round(waited_s, 1), "deadline_s": timeout}
        with contextlib.suppress(OSError):  # the run's folder gone: nobody is watching
            path.with_suffix(".tmp").write_text(json.dumps(notice))
            os.replace(path.with_suffix(".tmp"), path)

    try:
        yield announce
    finally:
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)


def overdue(folder: str | os.PathLike) -> list[dict]:
    """The notices in `folder` now, longest wait first (what a progress display shows)."""
    found = []
    for path in Path(folder).glob("*.json"):
        with contextlib.suppress(OSError, ValueError):
            found.append(json.loads(path.read_text()))
    return sorted(found, key=lambda n: -n["waited_s"])


def describe(notice: dict) -> str:
    """`waiting 42 s on test_x.py::test_y[...]: rank 1 of 2 not answered (deadline 60 s, --rank-timeout)`"""
    ranks = notice["pending"]
    who = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} of {notice['world_size']}"
    return (f"waiting {notice['waited_s']:.0f} s on {notice['test']}: {who} not answered "
            f"(deadline {notice['deadline_s']:g} s, --rank-timeout)")


def unfinished(rank: int, stack: str, results: dict[int, RankResult], timeout: float,
               label: str = "") -> RankResult:
    """The result of a rank still running when the wait ended, with its Python stack: a hang, or,
    when another rank had failed, a rank the harness stopped. `label` qualifies the rank (thread)."""
    failed = [res for res in results.values() if res.outcome == "failed"]
    if failed:
        root = min(failed, key=root_first)
        why = f"was still running {FAILURE_GRACE_S:g} s after rank {root.rank} failed; stopped"
    else:
        why = (f"did not finish within the {timeout:g} s deadline (hang?); a slow test raises it with "
               f"@distributed(timeout=), --shardcheck-rank-timeout (shardcheck run --rank-timeout)")
    return RankResult(rank, "failed", f"rank {rank}{label} {why}.\nIts Python stack:\n{stack}",
                      stopped=bool(failed))


def no_result(rank: int) -> RankResult:
    """The result of a rank that ended without producing one."""
    return RankResult(rank, "failed", f"rank {rank} produced no result")
