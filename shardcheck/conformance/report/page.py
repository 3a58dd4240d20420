"""The matrix as a self-contained HTML page (inline CSS; the chart an inline base64 PNG): the same
content as shardcheck.conformance.report.matrix.markdown, with a chart of coverage beside conformance per
implementation x layer, so a thin run cannot look green; per family, a grid of cells x
implementations coloured by outcome (the message or reason on hover); and, given several runs of an
implementation, its trend."""

from __future__ import annotations

import base64
import html
import io

import math

from shardcheck.conformance.checks.support.tolerances import dtype_of
from shardcheck.conformance.report import coverage, footprints, trend
from shardcheck.conformance.report.matrix import (FOLD, NOTE, column_sources, describe, failing, first_line, header,
                                                  known, known_counts, merge, newest_last, rate, rows, tabulate)

# The grid's mark and colour per outcome
MARKS = {"passed": ("✓", "#c9ecc9"), "failed": ("✗", "#f4b4b4"), "error": ("E", "#f4b4b4"),
         "xfailed": ("x", "#ffd9a8"), "xpassed": ("X", "#e0c4f0"), "unsupported": ("U", "#e4e4e4"),
         "skipped": ("s", "#f4f4f4")}

CSS = """
body{font-family:system-ui,sans-serif;margin:2rem;color:#222}h1{font-size:1.4rem}h2{font-size:1.1rem}
h3{font-size:1rem;margin-bottom:.2rem}table{border-collapse:collapse;margin:1rem 0}th,td{border:1px solid #ccc;
padding:.35rem .6rem;text-align:left;vertical-align:top;font-size:.9rem}th{background:#f3f3f3}td.rate b{font-size:1rem}
.full{background:#e3f6e3}.part{background:#fff4d6}.low{background:#fbe0e0}.na{color:#888}tr.all td,tr.all th{
border-top:2px solid #888}code{font-size:.85rem}.note{color:#555;font-size:.85rem}.warn{color:#a00}img{max-width:100%}
.finding{margin:1rem 0 1.5rem}.finding ul{margin:.3rem 0;font-size:.85rem}
table.grid td{padding:0 .3rem;text-align:center;font-size:.8rem}table.grid th{font-size:.75rem;font-weight:normal}
summary{cursor:pointer;margin:.3rem 0}
"""


def _css_class(value: float | None) -> str:
    return "na" if value is None else "full" if value == 100 else "part" if value >= 50 else "low"


def chart_png(table_rows) -> bytes:
    """Horizontal bars, two per implementation x layer: coverage (light) and conformance (dark)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    labels = [f"{column} · {layer}" for column, layer, _, _ in table_rows]
    fig = Figure(figsize=(8.0, 1.0 + 0.55 * max(1, len(labels))), dpi=100)
    ax = fig.subplots()
    ys = range(len(labels))
    for offset, key, color in ((-0.2, "coverage", "#9ecae1"), (0.2, "conformance", "#3182bd")):
        values = [tally[key] for _, _, tally, _ in table_rows]
        bars = ax.barh([y + offset for y in ys], [v or 0.0 for v in values], 0.38, label=key, color=color)
        ax.bar_label(bars, labels=[coverage.show(v) for v in values], fontsize=7, padding=2)
    ax.set_yticks(list(ys), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 112)
    ax.set_xlabel("% (coverage = reached / collected; conformance = passed / judged: bugs only)")
    ax.legend(fontsize=8, loc="lower right", frameon=False)
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def _fold(body: str, n: int) -> str:
    return body if n <= FOLD else f"<details><summary>{n} cells</summary>{body}</details>"


def _known_html(groups: list[dict]) -> str:
    e = html.escape
    if not groups:
        return "<p>None.</p>"
    parts = []
    for g in groups:
        impls = ", ".join(sorted({column for column, _ in g["cells"]}))
        items = "".join(f"<li>{e(column)} <code>{e(cid)}</code></li>" for column, cid in g["cells"])
        repro = f"<p>Reproduction: <code>{e(g['repro'])}</code></p>" if g["repro"] else ""
        parts.append(f'<div class="finding"><h3>{e(g["finding"] or "no finding id")} · {e(impls)} · '
                     f'{len(g["cells"])} cell(s) · {e(g["label"])}</h3><p>{e(g["reason"])}</p>{repro}{_fold(f"<ul>{items}</ul>", len(g["cells"]))}</div>')
    return "".join(parts)


def grid_html(cells: dict, columns: list[str]) -> str:
    """Per family, a folded table: a row per cell, a column per implementation, each square marked
    and coloured by its outcome, with the outcome and the failure's first line (or the reason it
    was not reached) on hover."""
    e = html.escape
    by_family: dict[str, dict[str, dict[str, dict]]] = {}
    for (column, cid), cell in cells.items():
        by_family.setdefault(cell["family"], {}).setdefault(cid, {})[column] = cell
    parts = []
    head = "".join(f"<th>{e(c)}</th>" for c in columns)
    for family in sorted(by_family):
        body = []
        for cid in sorted(by_family[family]):
            tds = []
            for column in columns:
                cell = by_family[family][cid].get(column)
                if cell is None:
                    tds.append("<td></td>")
                    continue
                mark, colour = MARKS.get(cell["outcome"], ("?", "#fff"))
                why = first_line(cell.get("message") or "")
                tip = f"{column}: {cell['outcome']}" + (f": {why}" if why else "")
                tds.append(f'<td style="background:{colour}" title="{e(tip)}">{mark}</td>')
            body.append(f"<tr><th><code>{e(cid)}</code></th>{''.join(tds)}</tr>")
        parts.append(f"<details><summary>{e(family)} ({len(body)} cells)</summary><table class=\"grid\">"
                     f"<thead><tr><th>cell</th>{head}</tr></thead><tbody>{''.join(body)}</tbody></table></details>")
    return "".join(parts)


STRIP_DECADES = (-6, 2)  # a strip's height spans margins 1e-6 to 1e2, on a log scale


def margin_strips_html(cells: dict, columns: list[str]) -> str:
    """Per implementation x dtype, every compared cell's worst margin (max |a-b| / (atol + rtol*|b|);
    1 is the tolerance) as a bar of an inline SVG strip, smallest first, on a log scale from 1e-6
    to 1e2: how close to its tolerance an implementation runs, not only whether it passed."""
    e = html.escape
    groups: dict[tuple[str, str], list[tuple[float, str]]] = {}
    for (column, cid), cell in cells.items():
        if cell.get("max_margin") is not None:
            groups.setdefault((column, dtype_of(cell["tolerances"])), []).append((cell["max_margin"], cid))
    if not groups:
        return "<p>No report here records margins (version 4 reports do).</p>"
    low, high = STRIP_DECADES
    height = 32

    def y(margin: float) -> float:
        level = (math.log10(margin) if margin > 0 else low) if margin < 10.0 ** high else high
        return height * (1 - (min(max(level, low), high) - low) / (high - low))

    body = []
    for column in columns:
        for dtype in sorted({d for c, d in groups if c == column}):
            margins = sorted(groups[(column, dtype)])
            bars = "".join(f'<rect x="{2 * i}" y="{y(m):.1f}" width="2" height="{height - y(m):.1f}" '
                           f'fill="{"#c33" if m > 1 else "#393"}"><title>{e(cid)}: {m:.3g}</title></rect>'
                           for i, (m, cid) in enumerate(margins))
            width = max(2 * len(margins), 40)
            svg = (f'<svg width="{width}" height="{height}" role="img" aria-label="margins">{bars}'
                   f'<line x1="0" x2="{width}" y1="{y(1.0):.1f}" y2="{y(1.0):.1f}" stroke="#888" '
                   f'stroke-dasharray="3,2"/></svg>')
            worst = margins[-1][0]
            body.append(f"<tr><th>{e(column)}</th><td>{e(dtype)}</td><td>{len(margins)}</td>"
                        f'<td class="{"low" if worst > 1 else "full"}">{worst:.3g}</td><td>{svg}</td></tr>')
    return ('<table class="strips"><thead><tr><th>implementation</th><th>dtype</th><th>cells</th>'
            f'<th>worst margin</th><th>every cell, smallest first (dashed: the tolerance)</th></tr></thead>'
            f'<tbody>{"".join(body)}</tbody></table>')


def trend_html(reports: list[dict]) -> str:
    """Each implementation's coverage and conformance in every report that has it, oldest first:
    shown when some implementation was run more than once."""
    e = html.escape
    runs = newest_last(reports)
    tallies = [coverage.by_impl(report["cells"], bugs_only=True) for report in runs]
    impls = sorted({impl for tally in tallies for impl in tally})
    if not any(sum(impl in tally for tally in tallies) > 1 for impl in impls):
        return "<p>One run per implementation: no trend.</p>"
    head = "".join(f"<th>{e((r.get('started') or '?')[:16])}</th>" for r in runs)
    body = []
    for impl in impls:
        tds = []
        for tally in tallies:
            t = tally.get(impl, {}).get(coverage.ALL)
            tds.append("<td>–</td>" if t is None else
                       f'<td class="rate {_css_class(t["conformance"])}"><b>{coverage.show(t["conformance"])}</b> '
                       f'of {coverage.show(t["coverage"])} reached</td>')
        body.append(f"<tr><th>{e(impl)}</th>{''.join(tds)}</tr>")
    return f'<table class="trend"><thead><tr><th>implementation</th>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'


def releases_html(cells: dict, reports: list[dict]) -> str:
    """Per implementation run on several releases (of torch, or its own): outcome counts over the cells every release
    collected, and each finding's state per release (shardcheck.conformance.report.trend)."""
    e = html.escape
    across = trend.by_release(cells, column_sources(reports))
    if not trend.spans_releases(across):
        return "<p>One release per implementation.</p>"
    out = []
    for impl, rels in across.items():
        if len(rels) < 2:
            continue
        head = "".join(f"<th>{e(rel)}</th>" for rel in rels)
        per = trend.counts(rels)
        counted = "".join(f"<td>{e(describe(c))}{f' (+{extra} apart)' if extra else ''}</td>" for c, extra in per.values())
        found = "".join(f"<tr><th>{e(finding)}</th>{''.join(f'<td>{e(s)}</td>' for s in states.values())}"
                        f"<td>{'</td><td>'.join(map(e, trend.first_broken_and_fixed(states)))}</td></tr>"
                        for finding, states in trend.findings(rels).items())
        out.append(f"<h3>{e(impl)} · {len(trend.frozen(rels))} cells on every release</h3>"
                   f'<table class="releases"><thead><tr><th></th>{head}<th>first broken</th><th>first fixed</th>'
                   f"</tr></thead><tbody><tr><th>outcomes</th>{counted}<td></td><td></td></tr>{found}</tbody></table>")
    return "".join(out)


def html_page(reports: list[dict]) -> str:
    cells = merge(reports)
    families, columns, counts = tabulate(cells)
    table_rows = rows(cells)
    e = html.escape
    impl_rows = []
    for column, layer, tally, outcomes in table_rows:
        cov, conf = tally["coverage"], tally["conformance"]
        impl_rows.append(
            f'<tr class="{"all" if layer == coverage.ALL else ""}"><th>{e(column)}</th><td>{e(layer)}</td>'
            f'<td class="rate {_css_class(cov)}"><b>{coverage.show(cov)}</b> ({tally["reached"]}/{tally["collected"]})</td>'
            f'<td class="rate {_css_class(conf)}"><b>{coverage.show(conf)}</b> ({tally["passed"]}/{tally["judged"]})</td>'
            f"<td>{e(describe(outcomes))}</td></tr>")
    head = "".join(f"<th>{e(c)}</th>" for c in columns)
    family_rows = []
    for family in families:
        tds = []
        for c in columns:
            value = rate(counts[family, c])
            body = f"<b>{coverage.show(value)}</b><br>{e(describe(counts[family, c]))}" if counts[family, c] else "–"
            tds.append(f'<td class="rate {_css_class(value)}">{body}</td>')
        family_rows.append(f'<tr class="{"all" if family == "all" else ""}"><th>{e(family)}</th>{"".join(tds)}</tr>')
    try:
        chart = (f'<img alt="coverage and conformance per implementation and layer" '
                 f'src="data:image/png;base64,{base64.b64encode(chart_png(table_rows)).decode()}">')
    except ImportError:  # matplotlib is the extra `chart`
        chart = ('<p class="note">No chart: matplotlib is not installed '
                 "(<code>pip install 'shardcheck[chart]'</code>).</p>")
    try:
        memory = footprints.chart_svg(cells) if footprints.table(cells) else "<p>No report here measured memory.</p>"
    except ImportError:
        memory = '<p class="note">No chart: matplotlib is not installed.</p>'
    groups = known(cells)
    fails = failing(cells)
    fail_rows = "".join(f"<tr><td>{e(col)}</td><td><code>{e(cid)}</code></td><td>{e(msg)}</td></tr>"
                        for col, cid, msg in fails)
    failing_table = ('<table class="failing"><thead><tr><th>impl</th><th>cell</th><th>message</th></tr></thead>'
                     f"<tbody>{fail_rows}</tbody></table>" if fails else "<p>None.</p>")
    top = "".join(f'<p class="{"warn" if line.startswith("WARNING") else "note"}">{e(line)}</p>'
                  for line in header(reports))
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>shardcheck conformance matrix</title>
<style>{CSS}</style></head><body>
<h1>shardcheck conformance matrix</h1>{top}
<table class="impls"><thead><tr><th>implementation</th><th>layer</th><th>coverage</th><th>conformance</th>
<th>outcomes</th></tr></thead><tbody>{"".join(impl_rows)}</tbody></table>
<p class="note">{e(NOTE)}</p>
{chart}
<h2>By family</h2>
<table class="matrix"><thead><tr><th>family</th>{head}</tr></thead><tbody>{"".join(family_rows)}</tbody></table>
<h2>Every cell</h2>
<p class="note">Per family, a cell per row and an implementation per column: ✓ passed, ✗ failed, E error,
x known failure, X unexpectedly passed, U unsupported, s skipped; hover for the message or the reason.</p>
{grid_html(cells, columns)}
<h2>Memory per rank</h2>
<p class="note">Family sharding: held between steps as a share of unsharded training, against world size
(1/n dashed: perfect sharding).</p>
{memory}
<h2>Margins</h2>
<p class="note">How much of its tolerance each cell used: max |a - b| / (atol + rtol * |b|) over its
comparisons, 1 being the tolerance (hover a bar for the cell).</p>
{margin_strips_html(cells, columns)}
<h2>Trend</h2>
{trend_html(reports)}
<h2>Across releases</h2>
{releases_html(cells, reports)}
<h2>Known failures ({sum(len(g["cells"]) for g in groups)} cells, {len(groups)} findings)</h2>
<p class="note">By kind (docs/findings.md): {e(", ".join(f"{n} {k}" for k, n in known_counts(groups).items()) or "none")}.
Conformance counts the bugs only; by design, platform and misuse are set aside.</p>
{_known_html(groups)}
<h2>Failing cells ({len(fails)})</h2>
{failing_table}
</body></html>
"""
