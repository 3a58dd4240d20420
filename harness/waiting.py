"""Waiting for every rank's result: the one loop of the pool, thread and external modes, and what a
rank that never answered is reported as.

`wait_for_ranks` stops when every rank has answered, when the deadline passes, or FAILURE_GRACE_S
after the first failure (the other ranks get that long to report: blocked in a collective with the
failed rank, they never would). Each mode brings its `poll`, which blocks at most the time it is
given and returns the results that arrived: the pool waits on its pipes and process sentinels, the
thread mode joins its threads, the external mode exchanges every rank's result at once.
"""

from __future__ import annotations

import time
from typing import Callable

from harness.task import RankResult
from harness.verdict import root_first

FAILURE_GRACE_S = 1.0  # after one rank fails, how long the others get to report before they are stopped

# poll(pending ranks, seconds it may block) -> {rank: result} of the ranks that answered meanwhile
Poll = Callable[[set[int], float], dict[int, RankResult]]


def wait_for_ranks(world_size: int, timeout: float, poll: Poll) -> tuple[dict[int, RankResult], set[int]]:
    """Every rank's result, or as many as came before the deadline or the grace after a failure;
    returns (results by rank, ranks still pending)."""
    results: dict[int, RankResult] = {}
    pending = set(range(world_size))
    deadline = time.monotonic() + timeout
    stop_at = deadline
    while pending:
        arrived = poll(pending, max(0.0, stop_at - time.monotonic()))
        if not arrived and time.monotonic() >= stop_at:
            break
        for r, result in arrived.items():
            results[r] = result
            pending.discard(r)
            if result.outcome == "failed" and stop_at == deadline:
                stop_at = min(deadline, time.monotonic() + FAILURE_GRACE_S)
    return results, pending


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
