"""`shardcheck matrix REPORT... [--markdown OUT.md] [--html OUT.html] [--memory-chart OUT.svg]`: the
families x implementations table of reports (the tables and the page: shardcheck/conformance/report/publish.py).
Exit 0; 2 a file that is not a readable report; 3 an output path that cannot be written, checked
before anything is written (cli/exit_codes.py)."""

from __future__ import annotations

import sys
from pathlib import Path

from shardcheck.conformance.cli import exit_codes as codes


def add_parser(subparsers) -> None:
    matrix = subparsers.add_parser("matrix", help="families x implementations table from reports (Markdown, HTML)")
    matrix.add_argument("reports", nargs="+", metavar="REPORT", help="JSON reports to merge")
    matrix.add_argument("--markdown", metavar="OUT.md", help="write the Markdown here (default: stdout)")
    matrix.add_argument("--html", metavar="OUT.html", help="write a self-contained HTML page with a chart")
    matrix.add_argument("--memory-chart", metavar="OUT.svg",
                        help="write the family sharding's memory per rank against world size (matplotlib)")


def main(args) -> int:
    from shardcheck.conformance.report import publish  # matplotlib loads only for this command
    from shardcheck.conformance.report.stream import unwritable

    for option, path in (("--markdown", args.markdown), ("--html", args.html), ("--memory-chart", args.memory_chart)):
        if path and (problem := unwritable(Path(path), stream=False)):
            print(f"shardcheck: {option}: cannot write: {problem}", file=sys.stderr)
            return codes.UNWRITABLE
    publish.write(args)
    return codes.OK
