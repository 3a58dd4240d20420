"""Reading conformance reports: validation against conformance/report/schema.json (version 2), and
version 1 reports upgraded in memory (the matrix and diff read both).

Version 2 added, per cell, `layer` (behaviour / api, from conformance.checks.LAYERS) and the
expectation's `finding`; and `summary.by_impl` (coverage and conformance per implementation and
layer, conformance.report.coverage). A version 1 report gets them computed from its cells.
"""

from __future__ import annotations

import copy
import json
from functools import cache
from pathlib import Path

import jsonschema

from conformance.report import coverage

SCHEMA = Path(__file__).with_name("schema.json")
SCHEMA_VERSION = 2
READS = (1, 2)


class ReportError(Exception):
    """A report that cannot be read: the message is one line naming the file."""


@cache
def _validator():
    schema = json.loads(SCHEMA.read_text())
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


def validate(report) -> str | None:
    """The first schema violation as one line (`$.cells[3].outcome: 'x' is not one of ...`), or None.
    A version 1 report is validated as upgraded."""
    if isinstance(report, dict) and report.get("schema_version", SCHEMA_VERSION) not in READS:
        return (f"schema version {report['schema_version']!r}; this shardcheck reads versions "
                f"{', '.join(map(str, READS))}")
    error = jsonschema.exceptions.best_match(_validator().iter_errors(upgrade(report)))
    if error is None:
        return None
    message = " ".join(error.message.split())
    return f"{error.json_path}: {message[:200] + '...' if len(message) > 200 else message}"


def load(path: str | Path) -> dict:
    """The report at `path`, valid and as version 2; ReportError otherwise."""
    try:
        report = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ReportError(f"{path}: cannot read: {exc.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ReportError(f"{path}: not JSON: {exc}") from None
    problem = validate(report)
    if problem:
        raise ReportError(f"{path}: not a shardcheck report: {problem}")
    return upgrade(report)
