"""From N rank results to one verdict: every rank's outcome counts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from harness.task import RankResult


@dataclass
class Verdict:
    outcome: str  # passed | failed | skipped
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
    """The line a reader needs first: the exception (last line of a traceback) or the first line."""
    lines = [line for line in message.strip().splitlines() if line.strip()]
    if not lines:
        return "failed"
    if lines[0].startswith("Traceback"):  # the exception line ends the indented frames
        return next((line for line in lines[1:] if not line[0].isspace()), lines[-1]).strip()
    return lines[0].strip()


def trim_stack(text: str) -> str:
    """faulthandler's dump, minus the harness's own threads and the frames below the test body."""
    blocks = []
    for block in text.strip().split("\n\n"):
        if "in watchdog" in block:
            continue
        kept = []
        for line in block.splitlines():
            if "/harness/task.py" in line:
                break
            kept.append(line)
        blocks.append("\n".join(kept))
    return "\n\n".join(blocks) or text


def decide(results: list[RankResult]) -> Verdict:
    failed = [r for r in results if r.outcome == "failed"]
    skipped = [r for r in results if r.outcome == "skipped"]
    if failed:
        # Ranks that failed on their own first; ranks stopped because of them after.
        failed.sort(key=lambda r: (r.stopped, r.rank))
        first = summary_line(failed[0].message)
        if not first.startswith(f"rank {failed[0].rank} "):
            first = f"rank {failed[0].rank}: {first}"
        header = f"{first} ({len(failed)} of {len(results)} ranks failed)"
        body = "\n".join(f"---------- rank {r.rank} ----------\n{r.message.rstrip()}" for r in failed)
        return Verdict("failed", f"{header}\n{body}", results)
    if skipped and len(skipped) == len(results):
        reasons = sorted({r.message for r in skipped})
        return Verdict("skipped", "; ".join(reasons), results)
    if skipped:
        detail = ", ".join(f"rank {r.rank} skipped ({r.message})" for r in skipped)
        return Verdict("failed", f"ranks disagree: {detail}; the others passed", results)
    return Verdict("passed", "", results)
