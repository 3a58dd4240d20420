"""`shardcheck matrix` and `shardcheck diff`: their parsers, and running them (the tables and the
page in shardcheck/conformance/report/publish.py, the regressions in report/diff.py)."""

from __future__ import annotations

import sys


def add_parser(sub) -> None:
    matrix = sub.add_parser("matrix", help="families x implementations table from reports (Markdown, HTML)")
    matrix.add_argument("reports", nargs="+", metavar="REPORT", help="JSON reports to merge")
    matrix.add_argument("--markdown", metavar="OUT.md", help="write the Markdown here (default: stdout)")
    matrix.add_argument("--html", metavar="OUT.html", help="write a self-contained HTML page with a chart")
    matrix.add_argument("--memory-chart", metavar="OUT.svg",
                        help="write the family sharding's memory per rank against world size (matplotlib)")
    diff = sub.add_parser("diff", help="cells that regressed, got fixed, appeared or vanished; "
                                       "exit code 1 on a regression")
    diff.add_argument("old", metavar="OLD", help="the earlier JSON report")
    diff.add_argument("new", metavar="NEW", help="the later JSON report")


def main(args) -> int:
    from shardcheck.conformance.cli import exit_codes as codes
    from shardcheck.conformance.report import diff, publish  # matplotlib and rich load only for these commands
    from shardcheck.conformance.report.reading import ReportError

    try:
        return (publish.main if args.command == "matrix" else diff.main)(args)
    except ReportError as exc:
        print(f"shardcheck: {exc}", file=sys.stderr)
        return codes.USAGE
