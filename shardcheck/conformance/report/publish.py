"""`shardcheck matrix`: merge reports (matrix.py) and write what was asked: the Markdown tables, the
HTML page (page.py, which renders the same tables) and the memory chart (footprints.py). The one
module that uses both the tables and the page, so each of them is used in one direction only."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from shardcheck.conformance.report import footprints
from shardcheck.conformance.report.matrix import load, markdown, merge


def write(args) -> None:
    """What `shardcheck matrix` was asked for (args: reports, markdown, html, memory_chart; the command
    itself, its parser and exit status: shardcheck/conformance/cli/matrix.py)."""
    from shardcheck.conformance.report import page  # matplotlib: only for the HTML page

    reports = [load(path) for path in args.reports]
    conflicts: list = []
    merge(reports, conflicts)
    paths = {id(report): path for report, path in zip(reports, args.reports)}
    for column, cid, kept, kept_in, dropped, dropped_in in conflicts:
        print(f"shardcheck matrix: {column} {cid}: {kept['outcome']} ({paths[id(kept_in)]}) over "
              f"{dropped['outcome']} ({paths[id(dropped_in)]})", file=sys.stderr)
    chart = getattr(args, "memory_chart", None)
    if chart:
        Path(chart).parent.mkdir(parents=True, exist_ok=True)
        Path(chart).write_text(footprints.chart_svg(merge(reports)))
        print(f"shardcheck: memory chart written to {chart}")
    linked = chart and os.path.relpath(chart, Path(args.markdown).parent if args.markdown else ".")
    if not args.markdown and not args.html:
        print(markdown(reports, linked), end="")
    for path, render in ((args.markdown, lambda r: markdown(r, linked)), (args.html, page.html_page)):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(render(reports))
            print(f"shardcheck: matrix written to {path}")
