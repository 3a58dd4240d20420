"""`shardcheck diff OLD NEW`: the cells that regressed, got fixed, appeared or vanished between two
reports (shardcheck/conformance/report/diff.py). Exit 0; 1 on a regression, and when either report
is incomplete; 2 a file that is not a readable report (cli/exit_codes.py)."""

from __future__ import annotations

from shardcheck.conformance.cli import exit_codes as codes


def add_parser(subparsers) -> None:
    diff = subparsers.add_parser("diff", help="cells that regressed, got fixed, appeared or vanished; "
                                              "exit code 1 on a regression")
    diff.add_argument("old", metavar="OLD", help="the earlier JSON report")
    diff.add_argument("new", metavar="NEW", help="the later JSON report")


def main(args) -> int:
    from shardcheck.conformance.report import diff  # rich loads only for this command

    return codes.OK if diff.compare(args.old, args.new) else codes.FAILED
