"""Reading conformance reports of every version this shardcheck reads (READS): validation against
their schema (the version the writer writes, SCHEMA_VERSION, read from schema.json's own
`schema_version`: schema.json; an earlier version N: schema-vN.json; versions 1 and 2: schema-v2.json,
version 1 upgraded first),
and `load`, which gives every version the same shape: full cells (version 2's) under `cells`.

Version 2 added, per cell, `layer` (behaviour / api, from shardcheck.conformance.checks.LAYERS) and the
expectation's `finding`; and `summary.by_impl` (coverage and conformance per implementation and
layer, shardcheck.conformance.report.coverage). A version 1 report gets them computed from its cells.
Version 3 writes the cells as rows through tables (shardcheck.conformance.report.compact), their texts trimmed
(shardcheck.conformance.report.texts) and the full texts in the stream its `full_text` names.
"""

from __future__ import annotations

import copy
import json
from functools import cache
from pathlib import Path
from typing import Any, TypedDict

import jsonschema

from shardcheck.conformance.report import compact, coverage
from shardcheck.errors import UsageError

SCHEMA = Path(__file__).with_name("schema.json")  # the version the writer writes
# version 7 = version 6 with the optional `split` (a part of a split run, or the merge of its parts);
# version 6 = version 5 with the target's `unjudged` line (the torch release not judged, or null);
# version 5 = version 4 with a cell's measured footprint (family sharding) as a last row column;
# version 4 = version 3 with a cell's worst margin as a last row column; version 1 is read as version 2
# the one place the version is written: the schema's `schema_version` const
SCHEMA_VERSION: int = json.loads(SCHEMA.read_text())["properties"]["schema_version"]["const"]
SCHEMAS = {SCHEMA_VERSION: SCHEMA, **{v: SCHEMA.with_name(f"schema-v{v}.json") for v in range(2, SCHEMA_VERSION)}}
READS = (1, *sorted(SCHEMAS))


class Cell(TypedDict):
    """One cell as `load` gives it (every version: version 2's full shape, under `report["cells"]`), and as
    the writer makes it before compact.encode writes it as a row. A typed name for the readers: the JSON is
    unchanged (tests/conformance/test_reports.py holds every committed report's cells to these keys)."""

    nodeid: str
    phase: str                       # the pytest phase that decided the outcome: setup, call, teardown
    outcome: str                     # one of protocol.outcomes.Outcome
    family: str
    layer: str                       # behaviour, api, or other (report.coverage.layer_of)
    check: str                       # the test function
    impl: str                        # the implementation's id, variant included: torch-fsdp1[flat]
    world_size: int | None
    params: dict[str, Any]
    duration_s: float
    message: str
    rank_outcomes: dict[str, str]    # {rank: harness.vocabulary.RankOutcome}
    max_abs_err: float | str | None  # a str for inf and nan
    max_rel_err: float | str | None
    tolerances: list[dict[str, Any]]
    expectation: dict[str, Any] | None  # the manifest entry of a known failure
    max_margin: float | None
    footprint: dict[str, Any] | None    # the family sharding's figures (measure.promises.judge)


def cells_of(report: dict) -> list[Cell]:
    """The cells of a report `load` gave (any version, expanded)."""
    return report["cells"]


class ReportError(UsageError):
    """A report that cannot be read: the message is one line naming the file."""


@cache
def _validator(version: int):
    schema = json.loads(SCHEMAS[version].read_text())
    return jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)


def upgrade(report):
    """A version 1 report as version 2 (a copy); any other input unchanged."""
    if not (isinstance(report, dict) and report.get("schema_version") == 1):
        return report
    report = copy.deepcopy(report)
    report["schema_version"] = 2
    cells = report.get("cells")
    if isinstance(cells, list):
        for cell in cells:
            if isinstance(cell, dict) and isinstance(cell.get("family"), str):
                cell.setdefault("layer", coverage.layer_of(cell["family"]))
        summary = report.get("summary")
        if isinstance(summary, dict):
            try:
                summary.setdefault("by_impl", coverage.by_impl(cells))
            except (KeyError, TypeError, AttributeError):
                pass  # a malformed cell: validation names it
    return report


@cache
def _cell_validator():
    """Version 2's cell: what a stream's `cell` line holds (the writer streams full cells)."""
    defs = json.loads(SCHEMAS[2].read_text())["$defs"]
    return jsonschema.Draft202012Validator({"$defs": defs, "$ref": "#/$defs/cell"})


def cell_problem(cell) -> str | None:
    """Why a streamed cell is not one (one line), or None."""
    error = jsonschema.exceptions.best_match(_cell_validator().iter_errors(cell))
    return None if error is None else f"{error.json_path}: {' '.join(error.message.split())[:200]}"


def _references(report: dict) -> str | None:
    """The first index of a version 3 report's rows or cases that points past its table."""
    tables = {"case": "cases", "impl": "implementations", "text": "texts", "tolerances": "tolerances",
              "expectation": "expectations"}
    for i, row in enumerate(report["cells"]):
        for position, (column, value) in enumerate(zip(compact.COLUMNS, row)):
            for index in value if isinstance(value, list) else [value]:
                if column in tables and isinstance(index, int) and index >= len(report[tables[column]]):
                    return f"$.cells[{i}][{position}]: {column} {index} is past the end of {tables[column]}"
    for i, case in enumerate(report["cases"]):
        if case[0] >= len(report["tests"]):
            return f"$.cases[{i}][0]: test {case[0]} is not in tests"
        if len(case) - 2 != len(report["tests"][case[0]]["params"]):
            return f"$.cases[{i}]: {len(case) - 2} values for the test's {len(report['tests'][case[0]]['params'])} params"
    return None


def validate(report) -> str | None:
    """The first schema violation as one line (`$.cells[3].outcome: 'x' is not one of ...`), or None.
    A version 1 report is validated as upgraded; a version 3 report's indices must point into its tables."""
    version = report.get("schema_version", SCHEMA_VERSION) if isinstance(report, dict) else SCHEMA_VERSION
    if version not in READS:
        return (f"schema version {version!r}; this shardcheck reads versions "
                f"{', '.join(map(str, READS))}")
    error = jsonschema.exceptions.best_match(_validator(max(version, 2)).iter_errors(upgrade(report)))
    if error is None:
        return _references(report) if version >= 3 else None
    message = " ".join(error.message.split())
    return f"{error.json_path}: {message[:200] + '...' if len(message) > 200 else message}"


def expand(report: dict) -> dict:
    """A valid report of any version with full cells (version 2's shape) under `cells`; a version 3
    to 7 report keeps its `full_text` (and `split`) and drops its tables."""
    if report["schema_version"] < 3:
        return upgrade(report)
    tables = ("tests", "cases", "texts", "expectations", "tolerances", "cell_columns")
    return {**{k: v for k, v in report.items() if k not in tables}, "cells": compact.decode(report)}


def load(path: str | Path) -> dict:
    """The report at `path`, valid, with full cells (`expand`); ReportError otherwise."""
    try:
        report = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ReportError(f"{path}: cannot read: {exc.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ReportError(f"{path}: not JSON: {exc}") from None
    problem = validate(report)
    if problem:
        raise ReportError(f"{path}: not a shardcheck report: {problem}")
    return expand(report)
