"""Version 3 cells: the report's cells grouped by test, the parameter cases a test shares across
implementations written once, and each cell one short row; distinct texts and expectations written
once and named by their index. `encode` turns full cells (the version 2 shape, what the stream holds)
into the report's `texts`, `expectations` and `tests`; `decode` turns them back into full cells, so
everything that reads reports (matrix, diff, page, coverage) sees the same cells whatever the version.

    "tests": [{"nodeid": "shardcheck/conformance/checks/api/test_clip_grad.py::test_ddp_parity",
               "family": "clip_grad", "layer": "api", "check": "test_ddp_parity",
               "params": ["world_size", "max_norm", ...],
               "cases": [["ws2-1-1.0-FULL_SHARD-offload", 2, 1, 1.0, "FULL_SHARD", true], ...],
               "impls": [{"impl": "torch-fsdp1", "cells": [[0, "xfailed", 0.1152, {"0,1": "failed"}, 3, 0], ...]}]}]

A row is COLUMNS in order, trailing nulls left out; null is the column's default (DEFAULTS). Its
nodeid is the test's, with `[<the implementation's id>-<case id>]` (shardcheck.conformance.report.cells spells
the id without the implementation the same way); a cell whose nodeid is spelled otherwise carries
it in the `nodeid` column.
"""

from __future__ import annotations

import json

COLUMNS = ("case", "impl", "outcome", "duration_s", "phase", "text", "ranks", "max_abs_err", "max_rel_err",
           "tolerances", "expectation", "nodeid", "max_margin", "footprint")  # version 3's rows stop before
# max_margin, version 4's before footprint
DEFAULTS = {"phase": "call", "text": "", "ranks": {}, "max_abs_err": None, "max_rel_err": None,
            "tolerances": [], "expectation": None, "nodeid": None, "max_margin": None,
            "footprint": None}
LARGEST = 1.7976931348623157e308  # the margin of a NaN or infinity on one side only (JSON has no inf)
RANK_OUTCOME = {"passed": "passed", "xpassed": "passed", "failed": "failed", "error": "failed",
                "xfailed": "failed", "skipped": "skipped", "unsupported": "skipped"}  # what its ranks said
WIDTH = 120  # a list or object whose JSON fits in this many characters is written on one line


def group_ranks(rank_outcomes: dict, outcome: str):
    """Rank outcomes as the report keeps them: n when ranks 0..n-1 all said what the cell's outcome
    implies (RANK_OUTCOME); else ranks that agree grouped, {"0,2": "failed", "1": "passed"}."""
    ranks = sorted(rank_outcomes, key=int)
    if ranks == [str(r) for r in range(len(ranks))] and {rank_outcomes[r] for r in ranks} == {RANK_OUTCOME.get(outcome)}:
        return len(ranks)
    groups: dict[str, list[str]] = {}
    for rank in ranks:
        groups.setdefault(rank_outcomes[rank], []).append(rank)
    return {",".join(ranks): said for said, ranks in groups.items()}


def ungroup_ranks(grouped, outcome: str) -> dict:
    if isinstance(grouped, int):
        return {str(rank): RANK_OUTCOME[outcome] for rank in range(grouped)}
    return dict(sorted(((rank, said) for ranks, said in (grouped or {}).items() for rank in ranks.split(",")),
                       key=lambda item: int(item[0])))


def _significant(value):
    """A measured error to 4 significant digits (the stream keeps it whole)."""
    return float(f"{value:.4g}") if isinstance(value, float) else value


def _margin(value):
    """A cell's worst margin to 4 significant digits, never past the largest float (an infinite
    margin is written as LARGEST)."""
    if value is None:
        return None
    return min(float(f"{value:.4g}"), LARGEST) if value < LARGEST else LARGEST


def _compact_footprint(value):
    """A cell's footprint as the report keeps it: whole bytes, without the ratios (each is its
    `measured` over its `unsharded` or `formula`)."""
    if isinstance(value, dict):
        return {k: _compact_footprint(v) for k, v in value.items() if k != "ratio"}
    if isinstance(value, list):
        return [_compact_footprint(v) for v in value]
    return round(value) if isinstance(value, float) else value


def _split(nodeid: str) -> tuple[str, str | None]:
    """`f.py::test_x[a-b]` -> (`f.py::test_x`, `a-b`); no brackets -> (nodeid, None)."""
    head, _, name = nodeid.rpartition("::")
    stem, bracket, params = name.partition("[")
    return (f"{head}::{stem}" if head else stem), (params[:-1] if bracket else None)


def _join(test: str, impl_id: str | None, case: str) -> str:
    params = f"{impl_id}-{case}" if impl_id and case else (impl_id or case)
    return f"{test}[{params}]" if params else test


def _case_id(params: str | None, impl_id: str | None) -> str:
    if not params or not impl_id:
        return params or ""
    return "" if params == impl_id else params.removeprefix(f"{impl_id}-")


class _Table(list):
    """Distinct values, each once, named by their index."""

    def __init__(self):
        super().__init__()
        self.seen: dict[str, int] = {}

    def add(self, value) -> int:
        key = json.dumps(value, sort_keys=True)
        if key not in self.seen:
            self.seen[key] = len(self)
            self.append(value)
        return self.seen[key]


def _impl(cell: dict, implementations: list[dict], test_id: str, params: str | None):
    """(the cell's implementation as its index in `implementations`: the entry whose id its nodeid
    carries, or its name when none is listed; that id)."""
    if cell["impl"] is None:
        return None, None
    listed = [(i, e["selected_as"]) for i, e in enumerate(implementations) if e["name"] == cell["impl"]]
    for index, impl_id in listed:
        if _join(test_id, impl_id, _case_id(params, impl_id)) == cell["nodeid"]:
            return index, impl_id
    return listed[0] if listed else (cell["impl"], None)


def encode(cells: list[dict], implementations: list[dict], split=lambda text: [text]) -> dict:
    """{"tests", "cases", "texts", "expectations", "tolerances", "cells"} for full cells (their
    `message` as the report keeps it; `split` cuts it into the pieces stored once each)."""
    tests, cases, texts, expectations, tolerances = _Table(), _Table(), _Table(), _Table(), _Table()
    rows = []
    for cell in cells:
        test_id, params = _split(cell["nodeid"])
        names = list(cell["params"])
        test = tests.add({"nodeid": test_id, "family": cell["family"], "layer": cell["layer"],
                          "check": cell["check"], "params": names})
        impl, impl_id = _impl(cell, implementations, test_id, params)
        case_id = _case_id(params, impl_id)
        pieces = split(cell["message"]) if cell["message"] else []
        if "\n".join(pieces) != cell["message"]:
            pieces = [cell["message"]]
        text = [texts.add(piece) for piece in pieces]
        values = {
            "case": cases.add([test, case_id, *(cell["params"][n] for n in names)]), "impl": impl,
            "outcome": cell["outcome"], "duration_s": round(cell["duration_s"], 3), "phase": cell["phase"],
            "text": text[0] if len(text) == 1 else text or "",
            "ranks": group_ranks(cell["rank_outcomes"], cell["outcome"]),
            "max_abs_err": _significant(cell["max_abs_err"]), "max_rel_err": _significant(cell["max_rel_err"]),
            "tolerances": tolerances.add(cell["tolerances"]) if cell["tolerances"] else [],
            "expectation": expectations.add(cell["expectation"]) if cell["expectation"] is not None else None,
            "nodeid": None if _join(test_id, impl_id, case_id) == cell["nodeid"] else cell["nodeid"],
            "max_margin": _margin(cell.get("max_margin")),
            "footprint": _compact_footprint(cell.get("footprint")),
        }
        row = [None if c in DEFAULTS and values[c] == DEFAULTS[c] else values[c] for c in COLUMNS]
        while row[-1] is None:
            row.pop()
        rows.append(row)
    return {"tests": list(tests), "cases": list(cases), "texts": list(texts), "expectations": list(expectations),
            "tolerances": list(tolerances), "cells": rows}


def decode(report: dict) -> list[dict]:
    """The full cells of a version 3 report, in its order."""
    impls = report["implementations"]
    cells = []
    for row in report["cells"]:
        values = {**DEFAULTS, **dict(zip(COLUMNS, row))}
        test_index, case_id, *case_values = report["cases"][values["case"]]
        test = report["tests"][test_index]
        params = dict(zip(test["params"], case_values))
        impl = values["impl"]
        listed = isinstance(impl, int)
        text = values["text"]
        exp, tol = values["expectation"], values["tolerances"]
        cells.append({
            "nodeid": values["nodeid"] or _join(test["nodeid"], impls[impl]["selected_as"] if listed else None, case_id),
            "phase": values["phase"] or "call", "outcome": values["outcome"],
            "family": test["family"], "layer": test["layer"], "check": test["check"],
            "impl": impls[impl]["name"] if listed else impl,
            "world_size": params.get("world_size"), "params": params, "duration_s": values["duration_s"],
            "message": "\n".join(report["texts"][i] for i in ([text] if isinstance(text, int) else text or [])),
            "rank_outcomes": ungroup_ranks(values["ranks"], values["outcome"]),
            "max_abs_err": values["max_abs_err"], "max_rel_err": values["max_rel_err"],
            "tolerances": report["tolerances"][tol] if isinstance(tol, int) else [],
            "expectation": report["expectations"][exp] if exp is not None else None,
            "max_margin": values["max_margin"],
            "footprint": values["footprint"],
        })
    return cells


def dumps(value, indent: int = 0) -> str:
    """JSON with short lists and objects on one line (at most WIDTH characters), longer ones one
    item a line: a cell a line, easy to grep and to diff."""
    flat = json.dumps(value, separators=(",", ":"))
    if len(flat) + indent <= WIDTH or not isinstance(value, (list, dict)) or not value:
        return flat
    pad = " " * (indent + 1)
    if isinstance(value, list):
        items = [pad + dumps(v, indent + 1) for v in value]
        return "[\n" + ",\n".join(items) + "\n" + " " * indent + "]"
    items = [f"{pad}{json.dumps(k)}: {dumps(v, indent + 1)}" for k, v in value.items()]
    return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"


def dump_report(report: dict) -> str:
    """The report as `dumps` writes it, its own keys at the margin: a row a line, one space in."""
    return "{\n" + ",\n".join(f"{json.dumps(k)}: {dumps(v)}" for k, v in report.items()) + "\n}\n"
