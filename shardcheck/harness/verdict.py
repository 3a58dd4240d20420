"""From N rank results to one verdict: every rank's outcome counts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardcheck.harness.task import RankResult


@dataclass
class Verdict:
    outcome: str  # one of vocabulary.OUTCOMES
    message: str
    results: list[RankResult]

    def records(self) -> list[tuple[str, dict[int, list[Any]]]]:
        """Records merged across ranks: (key, {rank: [values in recording order]}), keys in
        first-seen order."""
        merged: dict[str, dict[int, list]] = {}
        for res in self.results:
            for key, value in res.records:
                merged.setdefault(key, {}).setdefault(res.rank, []).append(value)
        return list(merged.items())


def summary_line(message: str) -> str:
    """The line a reader needs first: the exception raised (of a chain, the last one: its causes
    come first in a traceback) or the first line."""
    lines = [line for line in message.strip().splitlines() if line.strip()]
    if not lines:
        return "failed"
    if lines[0].startswith("Traceback"):  # the exception line ends the indented frames of the last traceback
        start = max(i for i, line in enumerate(lines) if line.startswith("Traceback"))
        return next((line for line in lines[start + 1:] if not line[0].isspace()), lines[-1]).strip()
    return lines[0].strip()


def root_first(result: RankResult) -> tuple:
    """Sort key putting the root cause of a failure first, in time: ranks that failed on their own
    before ranks the harness stopped; a rank that died before ranks that raised (a peer's death is
    what makes the others raise, e.g. gloo's "Connection closed by peer", not the reverse); then
    the earliest failure; ranks that hung (no failure time) last."""
    when = result.failed_at if result.failed_at is not None else float("inf")
    return result.stopped, not result.died, when, result.rank


def _headline(failed: list[RankResult], world_size: int) -> str:
    root = failed[0]
    first = summary_line(root.message)
    if not first.startswith(f"rank {root.rank} "):
        first = f"rank {root.rank}: {first}"
    after = ""
    if root.failed_at is not None and len(failed) > 1:  # a real failure, not a hang everywhere
        others = ", ".join(str(r.rank) for r in failed[1:])
        after = f"; then, as a consequence, rank{'s' if len(failed) > 2 else ''} {others}"
    return f"{first} ({len(failed)} of {world_size} ranks failed{after})"


def decide(results: list[RankResult]) -> Verdict:
    failed = [r for r in results if r.outcome == "failed"]
    skipped = [r for r in results if r.outcome == "skipped"]
    if failed:
        failed.sort(key=root_first)  # the root cause (first to fail, in time) heads the report
        body = "\n".join(f"---------- rank {r.rank}{' (consequence)' if i and failed[0].failed_at else ''}"
                         f" ----------\n{r.message.rstrip()}" for i, r in enumerate(failed))
        return Verdict("failed", f"{_headline(failed, len(results))}\n{body}", results)
    if skipped and len(skipped) == len(results):
        reasons = sorted({r.message for r in skipped})
        return Verdict("skipped", "; ".join(reasons), results)
    if skipped:
        detail = ", ".join(f"rank {r.rank} skipped ({r.message})" for r in skipped)
        return Verdict("failed", f"ranks disagree: {detail}; the others passed", results)
    return Verdict("passed", "", results)


def not_started(error: BaseException) -> Verdict:
    """The verdict of a test whose ranks could not be started (no rank ran the body)."""
    return Verdict("failed", f"could not start the ranks: {error}", [])
