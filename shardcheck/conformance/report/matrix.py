"""The cross-implementation matrix of `shardcheck matrix` (the command itself: publish.py).

Reads JSON reports (shardcheck.conformance.report.reading: validated, version 1 upgraded), merges them (one per
implementation, or one run with several; for a cell in several reports a verdict beats
unsupported/skipped, then the newer run wins, whatever the order given: each such choice is
printed), and
renders, as Markdown (stdout by default, fit for a CI job summary) and a self-contained HTML page
(shardcheck.conformance.report.page):

- one row per implementation x layer (behaviour, api; a variant such as `torch-fsdp1[flat]` is an
  implementation of its own) with coverage beside conformance, so a run that reached few cells does
  not look green;
- the families x implementations table;
- memory per rank against world size from the family sharding (shardcheck.conformance.report.footprints; with
  `--memory-chart OUT.svg` also a picture, linked from the Markdown);
- the known failures (xfailed cells) grouped by finding, with reason and reproduction, by kind
  (shardcheck.conformance.expectations.kinds: bugs first, then what is set aside: by design,
  platform, misuse; a by-design cell judged by another engine's convention says "differs from DDP,
  by design (document)");
- the failing cells.

Coverage = cells that reached a verdict / cells collected; conformance = passed / judged, the cells
that reached a verdict less the known failures that are no bug (an xfailed bug counts as not
passed): shardcheck.conformance.report.coverage with bugs_only. Reports keep no kind: it is judged at
matrix time from the manifests (a finding they do not know counts as a bug).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path

from shardcheck.conformance.protocol.outcomes import BAD, NOT_REACHED, OUTCOMES
from shardcheck.conformance.expectations import kinds
from shardcheck.conformance.report import coverage, footprints, texts, trend
from shardcheck.conformance.report.cells import strip_impl
from shardcheck.conformance.report.reading import SCHEMA, SCHEMA_VERSION, Cell, ReportError, load, validate

__all__ = ["SCHEMA", "SCHEMA_VERSION", "ReportError", "load", "validate", "markdown"]
FOLD = 5                                  # longer lists of a finding's cells are folded (<details>)
NOTE = ("Coverage = cells that reached a verdict / cells collected (unsupported and skipped cells did not "
        "reach one). Conformance = passed / judged: the cells that reached a verdict, less the known failures "
        "that are no bug (by design, platform, misuse: set aside, listed apart below); a known bug counts as "
        "not passed. Kinds: docs/findings.md.")


def cell_id(report: dict, cell: Cell) -> str:
    """The cell's id without the implementation (shardcheck.conformance.report.cells.strip_impl), trying the id the
    implementation was selected as, then its name."""
    ids = [i["selected_as"] for i in report["implementations"] if i["name"] == cell["impl"]]
    for impl_id in ids + ([cell["impl"]] if cell["impl"] else []):
        found = strip_impl(cell["nodeid"], impl_id)
        if found is not None:
            return found
    path, _, rest = cell["nodeid"].partition("::")
    return f"{Path(path).name}::{rest}"


def first_line(message: str) -> str:
    """The line of a pytest long report that says what went wrong: its first `E   ` line, or else
    its first non-empty line."""
    lines = [line.strip() for line in texts.without_worker_line(message).splitlines() if line.strip()]
    errors = [line[1:].strip() for line in lines if line.startswith("E ")]
    line = (errors or lines or [""])[0]
    return line if len(line) <= 160 else line[:157] + "..."


def _backends(report: dict) -> str:
    return ",".join(report["target"]["backends"] or []) or "?"


def newest_last(reports: list[dict]) -> list[dict]:
    """The reports in the order they were run (`started`), whatever order they were given in."""
    return sorted(reports, key=lambda r: (r.get("started") or "", r.get("finished") or ""))


def column_sources(reports: list[dict]) -> dict[str, tuple[str, tuple[str, str]]]:
    """{column: (implementation, its release: trend.release)} for the columns `merge` makes."""
    tags = _tags(reports)
    return {_column(impl, report, tags): (impl, trend.release(report, impl))
            for report in reports for impl in {c["impl"] or "-" for c in report["cells"]}}


def _tags(reports: list[dict]) -> dict[str, set[tuple]]:
    tags = defaultdict(set)
    for report in reports:
        for impl in {c["impl"] or "-" for c in report["cells"]}:
            tags[impl].add((_backends(report), *trend.release(report, impl)))
    return tags


def _column(impl: str, report: dict, tags: dict) -> str:
    """The implementation, suffixed with the backends, the torch release and/or the implementation's
    own release, each where the same implementation comes from runs that differ in it."""
    varies = [len({t[i] for t in tags[impl]}) > 1 for i in range(3)]
    torch_release, own = trend.release(report, impl)
    suffix = [_backends(report)] * varies[0] + [trend.label((torch_release, own), (varies[1], varies[2]))] * (
        varies[1] or varies[2])
    return f"{impl} ({', '.join(suffix)})" if suffix else impl


def merge(reports: list[dict], conflicts: list | None = None) -> dict[tuple[str, str], Cell]:
    """{(column, cell id): cell}. The column is the implementation, suffixed with the backends and/or
    the release when the same implementation comes from runs that differ in them (`_column`).

    Where several reports hold the same cell, a verdict (passed, failed, xfailed, ...) beats a cell
    that reached none (unsupported, skipped: a run that could not run it says nothing about it), and
    between two of the same kind the newer run's wins. The result never depends on the order the
    reports are given in. Each such choice between two different outcomes is appended to
    `conflicts` as (column, cell id, kept cell, its report, dropped cell, its report)."""
    reports = newest_last(reports)
    tags = _tags(reports)
    cells, source = {}, {}
    for report in reports:
        names = {impl: _column(impl, report, tags) for impl in {c["impl"] or "-" for c in report["cells"]}}
        for cell in report["cells"]:
            key = (names[cell["impl"] or "-"], cell_id(report, cell))
            kept = cells.get(key)
            if kept is not None and kept["outcome"] not in NOT_REACHED and cell["outcome"] in NOT_REACHED:
                winner, loser = (kept, source[key]), (cell, report)
            else:
                winner, loser = (cell, report), (kept, source.get(key))
                cells.pop(key, None)  # a re-run cell moves to the end: the latest report's order
                cells[key], source[key] = cell, report
            if kept is not None and kept["outcome"] != cell["outcome"] and conflicts is not None:
                conflicts.append((*key, *winner, *loser))
    return cells


def tabulate(cells: dict[tuple[str, str], Cell]):
    """(families, columns, {(family, column): Counter of outcomes}), with an "all" row."""
    counts: dict[tuple[str, str], Counter] = defaultdict(Counter)
    for (column, _), cell in cells.items():
        verdict = coverage.verdict_of(cell)  # a known failure that is no bug: its kind
        counts[cell["family"], column][verdict] += 1
        counts["all", column][verdict] += 1
    families = sorted({f for f, _ in counts} - {"all"}) + ["all"]
    columns = list(dict.fromkeys(column for column, _ in cells))
    return families, columns, counts


def rate(counter: Counter) -> float | None:
    """Conformance of a family x implementation cell of the table: passed / judged (reached, less
    the known failures that are no bug), in percent."""
    ran = sum(n for outcome, n in counter.items() if outcome not in NOT_REACHED and outcome not in coverage.SET_ASIDE)
    return 100.0 * counter["passed"] / ran if ran else None


def describe(counter: Counter) -> str:
    return ", ".join(f"{counter[o]} {o}" for o in (*OUTCOMES, *coverage.SET_ASIDE) if counter[o])


def rows(cells: dict[tuple[str, str], Cell]) -> list[tuple[str, str, dict, Counter]]:
    """(implementation column, layer, coverage.tally, outcome counts): a row per layer an
    implementation has cells in, then its "all" row when it has more than one layer."""
    outcomes: dict[tuple[str, str], Counter] = defaultdict(Counter)
    flat = []
    for (column, _), cell in cells.items():
        layer = cell.get("layer") or coverage.layer_of(cell["family"])
        verdict = coverage.verdict_of(cell)
        flat.append({"impl": column, "family": cell["family"], "layer": layer, "outcome": cell["outcome"],
                     "kind": verdict if verdict in coverage.SET_ASIDE else None})
        outcomes[column, layer][verdict] += 1
        outcomes[column, coverage.ALL][verdict] += 1
    out = []
    for column, layers in coverage.by_impl(flat, bugs_only=True).items():
        for layer, tally in layers.items():
            if layer != coverage.ALL or len(layers) > 2:
                out.append((column, layer, tally, outcomes[column, layer]))
    return out


def known(cells: dict[tuple[str, str], Cell]) -> list[dict]:
    """The xfailed cells grouped by finding (or, without one, by reason): [{finding, reason, repro,
    kind, label, cells: [(column, cell id)]}], bugs first, then by design, platform, misuse; findings in
    number order first within a kind. `label`: "bug", "platform", ..., "by design (document)" or
    "differs from DDP, by design (document)" (shardcheck.conformance.expectations.kinds.label)."""
    groups: dict[str, dict] = {}
    for (column, cid), cell in cells.items():
        if cell["outcome"] != "xfailed":
            continue
        exp = cell.get("expectation") or {"reason": first_line(cell["message"]) or "xfail marker", "repro": ""}
        key = exp.get("finding") or exp["reason"]
        kind, document, convention = kinds.of_expectation(exp)
        group = groups.setdefault(key, {"finding": exp.get("finding"), "reason": exp["reason"],
                                        "repro": exp.get("repro", ""), "kind": kind,
                                        "label": kinds.label(kind, document, convention), "cells": []})
        group["cells"].append((column, cid))

    def order(group):
        finding = group["finding"] or ""
        digits = "".join(ch for ch in finding if ch.isdigit())
        return (kinds.KINDS.index(group["kind"]), not finding, int(digits) if digits else 0, finding, group["reason"])
    return sorted(groups.values(), key=order)


def known_counts(groups: list[dict]) -> dict[str, int]:
    """{kind: findings (groups) of that kind}, in kinds.KINDS order, kinds with none left out."""
    return {kind: n for kind in kinds.KINDS if (n := sum(g["kind"] == kind for g in groups))}


def failing(cells: dict[tuple[str, str], Cell]) -> list[tuple[str, str, str]]:
    return [(column, cid, first_line(cell["message"]))
            for (column, cid), cell in cells.items() if cell["outcome"] in BAD]


def header(reports: list[dict]) -> list[str]:
    torches = sorted({r["target"]["torch"] for r in reports})
    backends = sorted({_backends(r) for r in reports})
    lines = [f"{len(reports)} report(s) · torch {', '.join(torches)} · backend {', '.join(backends)}"]
    incomplete = sum(not r["complete"] for r in reports)
    if incomplete:
        lines.append(f"WARNING: {incomplete} report(s) incomplete (interrupted run): cells are missing")
    return lines


def _md(text: str) -> str:
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("`", "'").replace("\n", " ")


def _code(text: str) -> str:
    return f"`{text.replace('`', chr(39))}`"


def _ratio(tally: dict, what: str, part: str, whole: str) -> str:
    return f"{coverage.show(tally[what])} ({tally[part]}/{tally[whole]})"


def markdown(reports: list[dict], chart: str | None = None) -> str:
    """The matrix in Markdown; `chart`: the memory chart's path, as the Markdown links it."""
    cells = merge(reports)
    families, columns, counts = tabulate(cells)
    out = ["## shardcheck conformance matrix", "", *(f"{line}  " for line in header(reports)), "",
           "| implementation | layer | coverage | conformance | outcomes |", "|---|---|---|---|---|"]
    for column, layer, tally, outcomes in rows(cells):
        name = f"**{layer}**" if layer == coverage.ALL else layer
        out.append(f"| {_md(column)} | {name} | **{_ratio(tally, 'coverage', 'reached', 'collected')}** | "
                   f"{_ratio(tally, 'conformance', 'passed', 'judged')} | {describe(outcomes)} |")
    out += ["", NOTE, "", "### By family", "",
            "| family | " + " | ".join(_md(c) for c in columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for family in families:
        row = [f"**{coverage.show(rate(counts[family, c]))}** {describe(counts[family, c])}".rstrip()
               if counts[family, c] else "–" for c in columns]
        out.append(f"| {'**all**' if family == 'all' else _md(family)} | " + " | ".join(row) + " |")
    out += footprints.markdown(cells, chart)
    groups = known(cells)
    out += ["", f"### Known failures ({sum(len(g['cells']) for g in groups)} cells, {len(groups)} findings)", "",
            "By kind (docs/findings.md): " + (", ".join(f"{n} {kind}" for kind, n in known_counts(groups).items())
                                              or "none") + ". Conformance counts the bugs only."]
    shown = None
    for g in groups:
        if g["kind"] != shown:
            shown = g["kind"]
            out += ["", f"#### {'Bugs' if shown == kinds.BUG else f'Set aside: {shown}'} "
                        f"({sum(len(x['cells']) for x in groups if x['kind'] == shown)} cells)"]
        impls = sorted({column for column, _ in g["cells"]})
        out += ["", f"##### {_md(g['finding'] or 'no finding id')} · {_md(', '.join(impls))} · "
                    f"{len(g['cells'])} cell(s) · {_md(g['label'])}", "", _md(g["reason"]), ""]
        if g["repro"]:
            out += [f"Reproduction: {_code(g['repro'])}", ""]
        items = [f"- {_md(column)} {_code(cid)}" for column, cid in g["cells"]]
        out += items if len(items) <= FOLD else [f"<details><summary>{len(items)} cells</summary>", "",
                                                 *items, "", "</details>"]
    if not groups:
        out += ["", "None."]
    across = trend.by_release(cells, column_sources(reports))
    if trend.spans_releases(across):
        out += trend.markdown(across)
    fails = failing(cells)
    out += ["", f"### Failing cells ({len(fails)})"]
    if fails:
        out += ["", "| impl | cell | message |", "|---|---|---|"]
        out += [f"| {_md(col)} | {_code(cid)} | {_md(msg)} |" for col, cid, msg in fails]
    else:
        out += ["", "None."]
    return "\n".join(out) + "\n"
