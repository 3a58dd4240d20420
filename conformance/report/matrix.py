"""`shardcheck matrix REPORT... [--markdown OUT.md] [--html OUT.html]`: the cross-implementation matrix.

Reads JSON reports (validated against conformance/report/schema.json), merges them (one per
implementation, or one run with several; a later report's cell replaces an earlier one's), and
renders one table of check families x implementations with the failing cells below it:
Markdown (stdout by default, fit for a CI job summary) and a self-contained HTML page (inline CSS,
a bar chart of pass rates embedded as a base64 PNG).

Conformance = passed / cells that ran: unsupported and skipped cells are left out, an xfailed
(known) failure counts as not passed.
"""

from __future__ import annotations

import base64
import html
import io
import json
from collections import Counter, defaultdict
from functools import cache
from pathlib import Path

import jsonschema

from conformance.protocol.outcomes import BAD, NOT_REACHED, OUTCOMES
from conformance.report.cells import strip_impl

SCHEMA = Path(__file__).with_name("schema.json")
SCHEMA_VERSION = 1
NOT_RUN = NOT_REACHED                     # left out of the conformance percentage
FAILING = BAD                             # listed as failing cells
ORDER = OUTCOMES
NOTE = ("Conformance = passed / cells that ran (unsupported and skipped cells left out; "
        "an xfailed, known failure counts as not passed).")


class ReportError(Exception):
    """A report that cannot be read: the message is one line naming the file."""


@cache
def _validator():
    schema = json.loads(SCHEMA.read_text())
    return jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)


def validate(report) -> str | None:
    """The first schema violation as one line (`$.cells[3].outcome: 'x' is not one of ...`), or None."""
    if isinstance(report, dict) and report.get("schema_version", SCHEMA_VERSION) != SCHEMA_VERSION:
        return f"schema version {report['schema_version']!r}; this shardcheck reads version {SCHEMA_VERSION}"
    error = jsonschema.exceptions.best_match(_validator().iter_errors(report))
    if error is None:
        return None
    message = " ".join(error.message.split())
    return f"{error.json_path}: {message[:200] + '...' if len(message) > 200 else message}"


def load(path: str | Path) -> dict:
    try:
        report = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ReportError(f"{path}: cannot read: {exc.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ReportError(f"{path}: not JSON: {exc}") from None
    problem = validate(report)
    if problem:
        raise ReportError(f"{path}: not a shardcheck report: {problem}")
    return report


def cell_id(report: dict, cell: dict) -> str:
    """The cell's id without the implementation (conformance.report.cells.strip_impl), trying the id the
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
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    errors = [line[1:].strip() for line in lines if line.startswith("E ")]
    line = (errors or lines or [""])[0]
    return line if len(line) <= 160 else line[:157] + "..."


def _backends(report: dict) -> str:
    return ",".join(report["target"]["backends"] or []) or "?"


def merge(reports: list[dict]) -> dict[tuple[str, str], dict]:
    """{(column, cell id): cell}. The column is the implementation, suffixed with the backends when
    the same implementation comes from runs on different backends."""
    tags = defaultdict(set)
    for report in reports:
        for cell in report["cells"]:
            tags[cell["impl"] or "-"].add(_backends(report))
    cells = {}
    for report in reports:
        for cell in report["cells"]:
            impl = cell["impl"] or "-"
            column = impl if len(tags[impl]) == 1 else f"{impl} ({_backends(report)})"
            key = (column, cell_id(report, cell))
            cells.pop(key, None)  # a re-run cell moves to the end: the latest report's order
            cells[key] = cell
    return cells


def tabulate(cells: dict[tuple[str, str], dict]):
    """(families, columns, {(family, column): Counter of outcomes}), with an "all" row."""
    counts: dict[tuple[str, str], Counter] = defaultdict(Counter)
    for (column, _), cell in cells.items():
        counts[cell["family"], column][cell["outcome"]] += 1
        counts["all", column][cell["outcome"]] += 1
    families = sorted({f for f, _ in counts} - {"all"}) + ["all"]
    columns = list(dict.fromkeys(column for column, _ in cells))
    return families, columns, counts


def rate(counter: Counter) -> float | None:
    ran = sum(n for outcome, n in counter.items() if outcome not in NOT_RUN)
    return 100.0 * counter["passed"] / ran if ran else None


def _describe(counter: Counter) -> str:
    return ", ".join(f"{counter[o]} {o}" for o in ORDER if counter[o])


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}%"


def failing(cells: dict[tuple[str, str], dict]) -> list[tuple[str, str, str]]:
    return [(column, cid, first_line(cell["message"]))
            for (column, cid), cell in cells.items() if cell["outcome"] in FAILING]


def _header(reports: list[dict]) -> list[str]:
    torches = sorted({r["target"]["torch"] for r in reports})
    backends = sorted({_backends(r) for r in reports})
    lines = [f"{len(reports)} report(s) · torch {', '.join(torches)} · backend {', '.join(backends)}"]
    incomplete = sum(not r["complete"] for r in reports)
    if incomplete:
        lines.append(f"WARNING: {incomplete} report(s) incomplete (interrupted run): cells are missing")
    return lines


def _md(text: str) -> str:
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("`", "'")


def markdown(reports: list[dict]) -> str:
    cells = merge(reports)
    families, columns, counts = tabulate(cells)
    out = ["## shardcheck conformance matrix", "", *(f"{line}  " for line in _header(reports)), "",
           "| family | " + " | ".join(_md(c) for c in columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for family in families:
        row = [f"**{_percent(rate(counts[family, c]))}** {_describe(counts[family, c])}".rstrip()
               if counts[family, c] else "–" for c in columns]
        out.append(f"| {'**all**' if family == 'all' else _md(family)} | " + " | ".join(row) + " |")
    out += ["", NOTE, ""]
    fails = failing(cells)
    out.append(f"### Failing cells ({len(fails)})")
    if fails:
        out += ["", "| impl | cell | message |", "|---|---|---|"]
        out += [f"| {_md(col)} | `{cid.replace('`', chr(39))}` | {_md(msg)} |" for col, cid, msg in fails]
    else:
        out += ["", "None."]
    return "\n".join(out) + "\n"


def chart_png(families: list[str], columns: list[str], counts) -> bytes:
    """A grouped bar chart: pass rate per family (x) per implementation (one bar each)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(6.0, 1.2 + len(families) * (0.5 + 0.45 * len(columns))), 3.8), dpi=100)
    ax = fig.subplots()
    width = 0.8 / max(1, len(columns))
    for i, column in enumerate(columns):
        xs = [f + (i - (len(columns) - 1) / 2) * width for f in range(len(families))]
        rates = [rate(counts[family, column]) for family in families]
        bars = ax.bar(xs, [r or 0.0 for r in rates], width, label=column)
        ax.bar_label(bars, labels=["n/a" if r is None else f"{r:.0f}" for r in rates], fontsize=7, padding=1)
    ax.set_xticks(range(len(families)), families)
    ax.set_ylim(0, 112)
    ax.set_ylabel("conformance (% passed)")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncols=min(4, len(columns)), frameon=False)
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


CSS = """
body{font-family:system-ui,sans-serif;margin:2rem;color:#222}h1{font-size:1.4rem}h2{font-size:1.1rem}
table{border-collapse:collapse;margin:1rem 0}th,td{border:1px solid #ccc;padding:.35rem .6rem;text-align:left;
vertical-align:top;font-size:.9rem}th{background:#f3f3f3}td.rate b{font-size:1rem}.full{background:#e3f6e3}
.part{background:#fff4d6}.low{background:#fbe0e0}.na{color:#888}tr.all td{border-top:2px solid #888}
code{font-size:.85rem}.note{color:#555;font-size:.85rem}.warn{color:#a00}img{max-width:100%}
"""


def _css_class(value: float | None) -> str:
    return "na" if value is None else "full" if value == 100 else "part" if value >= 50 else "low"


def html_page(reports: list[dict]) -> str:
    cells = merge(reports)
    families, columns, counts = tabulate(cells)
    e = html.escape
    head = "".join(f"<th>{e(c)}</th>" for c in columns)
    rows = []
    for family in families:
        tds = []
        for c in columns:
            value = rate(counts[family, c])
            body = f"<b>{_percent(value)}</b><br>{e(_describe(counts[family, c]))}" if counts[family, c] else "–"
            tds.append(f'<td class="rate {_css_class(value)}">{body}</td>')
        rows.append(f'<tr class="{"all" if family == "all" else ""}"><th>{e(family)}</th>{"".join(tds)}</tr>')
    png = base64.b64encode(chart_png(families[:-1] or families, columns, counts)).decode()
    fails = failing(cells)
    fail_rows = "".join(f"<tr><td>{e(col)}</td><td><code>{e(cid)}</code></td><td>{e(msg)}</td></tr>"
                        for col, cid, msg in fails)
    failing_table = ('<table class="failing"><thead><tr><th>impl</th><th>cell</th><th>message</th></tr></thead>'
                     f"<tbody>{fail_rows}</tbody></table>" if fails else "<p>None.</p>")
    header = "".join(f'<p class="{"warn" if line.startswith("WARNING") else "note"}">{e(line)}</p>'
                     for line in _header(reports))
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>shardcheck conformance matrix</title>
<style>{CSS}</style></head><body>
<h1>shardcheck conformance matrix</h1>{header}
<table class="matrix"><thead><tr><th>family</th>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>
<p class="note">{e(NOTE)}</p>
<img alt="pass rate per family per implementation" src="data:image/png;base64,{png}">
<h2>Failing cells ({len(fails)})</h2>
{failing_table}
</body></html>
"""


def main(args) -> int:
    """The `shardcheck matrix` subcommand (args: reports, markdown, html)."""
    reports = [load(path) for path in args.reports]
    if not args.markdown and not args.html:
        print(markdown(reports), end="")
    for path, render in ((args.markdown, markdown), (args.html, html_page)):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(render(reports))
            print(f"shardcheck: matrix written to {path}")
    return 0
