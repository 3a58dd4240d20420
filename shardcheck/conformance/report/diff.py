"""`shardcheck diff OLD NEW`: what changed between two conformance reports.

Cells are matched by (implementation, cell id), the cell id being the nodeid without the
implementation (shardcheck.conformance.report.matrix.cell_id), so reports written from different folders or with the
implementation selected under another name still line up. Each matched pair falls in one bucket:

- regressed: passed, xpassed or xfailed before, failed or error now;
- fixed: failed, error or xfailed before, passed or xpassed now;
- changed: any other change of outcome (e.g. passed -> unsupported);
- appeared / vanished: in only one of the two reports.

Exit code 1 when any cell regressed, 0 otherwise (2 for a report that cannot be read).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from rich.console import Console
from rich.table import Column, Table
from rich.text import Text

from shardcheck.conformance.protocol.outcomes import BAD, GOOD
from shardcheck.conformance.report import matrix
from shardcheck.conformance.report.reading import Cell

KINDS = ("regressed", "fixed", "changed", "appeared", "vanished")
STYLE = {"regressed": "bold red", "fixed": "green", "changed": "yellow", "appeared": "cyan", "vanished": "magenta"}


@dataclass(frozen=True)
class Change:
    kind: str
    impl: str
    cell: str
    old: str | None  # outcome before (None: the cell did not exist)
    new: str | None
    message: str     # first line of the new (or, for a vanished cell, the old) message


def _cells(report: dict) -> dict[tuple[str, str], Cell]:
    return {(cell["impl"] or "-", matrix.cell_id(report, cell)): cell for cell in report["cells"]}


def _kind(old: str | None, new: str | None) -> str | None:
    if old is None:
        return "appeared"
    if new is None:
        return "vanished"
    if old == new:
        return None
    if old in GOOD + ("xfailed",) and new in BAD:
        return "regressed"
    if old in BAD + ("xfailed",) and new in GOOD:
        return "fixed"
    return "changed"


def diff(old_report: dict, new_report: dict) -> list[Change]:
    """The changes from old to new, regressions first, then in the new report's cell order."""
    old, new = _cells(old_report), _cells(new_report)
    changes = []
    for key in list(new) + [k for k in old if k not in new]:
        before, after = old.get(key), new.get(key)
        kind = _kind(before and before["outcome"], after and after["outcome"])
        if kind:
            changes.append(Change(kind, key[0], key[1], before and before["outcome"], after and after["outcome"],
                                  matrix.first_line((after or before)["message"])))
    return sorted(changes, key=lambda c: KINDS.index(c.kind))


def summary(changes: list[Change]) -> str:
    counts = {kind: sum(c.kind == kind for c in changes) for kind in KINDS}
    return ", ".join(f"{n} {kind}" for kind, n in counts.items())


def render(changes: list[Change], console: Console) -> None:
    if changes:
        table = Table(Column("change", min_width=9), "impl", Column("cell", overflow="fold", ratio=3),
                      Column("old", min_width=7), Column("new", min_width=7), Column("message", ratio=2))
        for c in changes:
            values = (c.impl, c.cell, c.old, c.new, c.message)
            table.add_row(Text(c.kind, style=STYLE[c.kind]), *(Text(v or "–") for v in values))
        console.print(table)
    console.print(summary(changes), highlight=False)


def compare(old_path, new_path) -> bool:
    """What `shardcheck diff OLD NEW` prints (shardcheck/conformance/cli/diff.py): whether the comparison
    is clean: no regression, and both reports complete (an interrupted or crashed run's missing cells
    would read as vanished)."""
    old, new = matrix.load(old_path), matrix.load(new_path)
    changes = diff(old, new)
    width = None if sys.stdout.isatty() else int(os.environ.get("COLUMNS", 160))  # CI logs are wide
    render(changes, Console(width=width))
    incomplete = [(path, report) for path, report in ((old_path, old), (new_path, new)) if not report["complete"]]
    for path, report in incomplete:
        print(f"shardcheck diff: {path} is incomplete (an interrupted or crashed run, "
              f"{len(report['cells'])} cells finished): this comparison is not clean", file=sys.stderr)
    return not incomplete and not any(c.kind == "regressed" for c in changes)
