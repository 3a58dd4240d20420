"""A selection of cells split into N parts that different machines run (`shardcheck run --split K/N`,
the pytest option `--shardcheck-split K/N`), and what a part's report says about it.

The split is deterministic: the same cells and the same recorded durations give the same parts on
every machine. Cells are weighed by the `duration_s` earlier reports recorded for them (a cell no
report timed weighs the mean of those that were; with none timed every cell weighs the same, a
split by count) and assigned greedily, longest first (ties by cell id), each to the part with the
least time so far (ties: fewer cells, then the lower part). Every cell lands in exactly one part;
a part runs its cells in the collection's order.

A cell is named by its file's name and the rest of its nodeid (`test_f.py::test_x[reference-ws2]`),
not by its path: a checkout and an installed shardcheck name it alike. A part's report carries
`split` (schema version 7): the part, the number of parts, `selection` (a fingerprint of every cell
of the whole selection: parts of different selections cannot be joined), `plan` (a fingerprint of
which part each cell went to: parts planned from other durations cannot either), `cells` (the whole
selection's count) and `timed` (how many of them a report timed). `shardcheck report merge` joins
the parts (shardcheck.conformance.report.merge).
"""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
import json
import re
from pathlib import Path

import pytest

RECORD = pytest.StashKey[dict]()  # a session's split record, where its report writer finds it
WORKER_OUTPUT = "shardcheck_split"  # the same record, sent from a pytest-xdist worker to its controller
DEFAULT_REPORTS = "reports/*.json"  # the committed reports, relative to the folder the run starts in
_SPEC = re.compile(r"\s*(\d+)\s*/\s*(\d+)\s*")


@dataclasses.dataclass(frozen=True)
class Split:
    part: int
    of: int

    def __str__(self) -> str:
        return f"{self.part}/{self.of}"


def parse(text: str) -> Split:
    """`"2/3"` -> Split(2, 3); ValueError (one line) for anything but K/N with 1 <= K <= N."""
    match = _SPEC.fullmatch(text)
    if not match or not 1 <= int(match[1]) <= int(match[2]):
        raise ValueError(f"{text!r} is not K/N, part K of N parts with 1 <= K <= N (e.g. 2/3)")
    return Split(int(match[1]), int(match[2]))


def key(nodeid: str) -> str:
    """A cell's id wherever the suite is installed: its file's name and the rest of its nodeid."""
    path, sep, rest = nodeid.partition("::")
    return f"{Path(path).name}{sep}{rest}"


def fingerprint(lines) -> str:
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def plan(keys: list[str], durations: dict[str, float], n: int) -> list[int]:
    """The part (1..n) of each cell, in the order of `keys`."""
    known = [durations[k] for k in keys if k in durations]
    mean = sum(known) / len(known) if known else 1.0
    weight = [max(0.0, durations.get(k, mean)) for k in keys]
    parts = [0] * len(keys)
    loads = [(0.0, 0, part) for part in range(1, n + 1)]  # (seconds, cells, part): the least first
    for i in sorted(range(len(keys)), key=lambda i: (-weight[i], keys[i], i)):
        seconds, count, part = heapq.heappop(loads)
        parts[i] = part
        heapq.heappush(loads, (seconds + weight[i], count + 1, part))
    return parts


def record(split: Split, keys: list[str], parts: list[int], durations: dict[str, float]) -> dict:
    """What a part's report says of its split (the schema's `split`)."""
    return {"part": split.part, "of": split.of, "selection": fingerprint(sorted(keys)),
            "plan": fingerprint(sorted(f"{p} {k}" for k, p in zip(keys, parts))),
            "cells": len(keys), "timed": sum(k in durations for k in keys)}


def durations_of(reports: list[dict]) -> dict[str, float]:
    """{cell key: duration_s} over reports read with full cells (reading.load); a later report's
    figure replaces an earlier one's."""
    return {key(cell["nodeid"]): float(cell["duration_s"]) for report in reports for cell in report["cells"]
            if isinstance(cell.get("duration_s"), (int, float))}


def default_reports(folder: Path, impls: set[str]) -> list[dict]:
    """The committed reports (DEFAULT_REPORTS under `folder`) of any of the implementations `impls`
    (by the name they were selected as), with full cells; a file that is not a report is passed over."""
    from shardcheck.conformance.report import reading

    found = []
    for path in sorted(folder.glob(DEFAULT_REPORTS)):
        try:
            report = json.loads(path.read_text(encoding="utf-8"))
            if {i.get("selected_as") for i in report.get("implementations") or []} & impls:
                found.append(reading.expand(report))  # not validated: costly for a whole report, and the reports are ours
        except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError):
            continue
    return found
