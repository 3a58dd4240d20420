"""`shardcheck run --split K/N [--durations REPORT...]`: part K of N of the selected cells, for N
machines (a job array, a CI matrix) whose reports `shardcheck report merge` joins. The split itself
is the pytest option `--shardcheck-split` (shardcheck.conformance.plugins.split): this module
declares the command's options, checks them before any cell runs and passes them through. docs/splitting.md."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from shardcheck.conformance.cli import exit_codes as codes


def k_of_n(text: str) -> str:
    """An argparse type: `K/N` as given, or a one-line usage error."""
    from shardcheck.conformance.report import split

    try:
        return str(split.parse(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(run) -> None:
    run.add_argument("--split", type=k_of_n, metavar="K/N",
                     help="run part K of N of the selected cells (the same parts on every machine, balanced by the "
                          "durations of --durations); `shardcheck report merge` joins the parts' reports")
    run.add_argument("--durations", nargs="+", metavar="REPORT",
                     help="reports whose cells' durations balance --split (default: the committed reports/*.json "
                          "of the implementations checked; none: split by count)")


def refused(args) -> int:
    """--durations checked before pytest starts: a report that cannot be read is one line, exit 2."""
    if args.durations and not args.split:
        print("shardcheck run: --durations balances --split: give --split K/N too", file=sys.stderr)
        return codes.USAGE
    from shardcheck.conformance.report.reading import ReportError, load

    for path in args.durations or []:
        try:
            load(path)
        except ReportError as exc:
            print(f"shardcheck run: --durations: {exc}", file=sys.stderr)
            return codes.USAGE
    return codes.OK


def pytest_args(args) -> list[str]:
    if not args.split:
        return []
    return [f"--shardcheck-split={args.split}", *(f"--shardcheck-durations={path}" for path in args.durations or [])]


def empty_part(out: Path) -> str | None:
    """The line for a part that holds no cell of a selection that has some (more parts than cells):
    its report is kept, for the merge; None when the selection itself is empty."""
    try:
        made = json.loads(out.read_text(encoding="utf-8")).get("split") or {}
    except (OSError, ValueError):
        return None
    if not made.get("cells"):
        return None
    return (f"shardcheck: part {made['part']}/{made['of']} holds none of the selection's {made['cells']} cells "
            f"(report written to {out}, for `shardcheck report merge`)")
