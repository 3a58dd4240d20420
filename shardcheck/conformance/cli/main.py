"""`shardcheck`: the command-line entry point.

    shardcheck run [--impl NAME]... [--backend gloo|threaded|nccl] [--world-sizes 2,4]
                   [--family clip_grad,...] [-k EXPR] [-o REPORT] [--min-coverage PCT]
                   [--split K/N [--durations REPORT...]] [-- pytest args]

runs the conformance matrix through pytest (the checks are pytest tests) and writes a JSON report,
with a progress bar on a terminal (plain progress lines elsewhere), a families x outcomes table and
coverage (cells that reached a verdict / cells collected) and conformance (passed / judged: the known
failures that are by design, platform or misuse set aside, docs/findings.md) per implementation and layer.
Exit code, the same for the same outcome in every command (shardcheck/conformance/cli/exit_codes.py):
0 when no cell failed or errored (xfailed and unsupported cells do not count) and every
implementation's coverage is at least --min-coverage (default 0: off, since an implementation
without FSDP-style APIs legitimately reaches few api cells; CI should set it), 1 otherwise; 2 a bad
option value or a file that cannot be read as what it should be; 3 an output path that cannot be
written; 4 an unknown name; 5 no cell selected; 6 an adapter that cannot be built; 7 report merge:
parts that are not one split run; 130 interrupted (Ctrl-C, however many: its report says complete:
false). Bad input is one line on stderr, checked before any cell runs, and leaves no file behind. A whole matrix runs on pytest-xdist
workers, one per core (`--workers N` sets it, 0 for this process alone; a selection runs here).

    shardcheck report assemble REPORT.jsonl [-o REPORT.json]
    shardcheck report upgrade REPORT.json [-o OUT.json]
    shardcheck report merge PART... -o OUT.json

rebuild the report from the cells a run streamed, e.g. after a crash (`complete: false`), rewrite
a report of an earlier schema version as the current one (in place by default), saying its size before and after,
and join the reports of `run --split 1/N` ... `N/N` into one (cli/splitting.py).

    shardcheck matrix REPORT... [--markdown OUT.md] [--html OUT.html] [--memory-chart OUT.svg]
    shardcheck diff OLD NEW
    shardcheck simulate --impl NAME --world-size N --model PRESET

the families x implementations table, the cells that regressed or got fixed between two reports
(exit 1 on regressions, and when either report is incomplete), and the fake-process-group
simulation of shard shapes, bytes and collectives at world sizes beyond the machine.
`run --launcher torchrun` runs on torchrun's ranks.

    shardcheck explore --impl NAME [--budget SECONDS] [--seed N]    (shardcheck/conformance/cli/explore.py)

draws whole training configurations, compares each with unsharded data-parallel training, and
shrinks a new failure to a minimal configuration with a one-line reproducer.

    shardcheck releases torch==2.9.1,2.14.1 [--impl NAME]... [-- run args]   (cli/releases.py)
runs the matrix on each release in a virtualenv of its own: one report per release and implementation.
`shardcheck cells --impl NAME`: the cells a declaration reaches, and what each capability would add.
"""

from __future__ import annotations

import argparse
import platform
import signal
import sys

from shardcheck.conformance.cli import cells, diff, explore, matrix, releases, report_commands, run, simulate
from shardcheck.conformance.cli import exit_codes as codes
from shardcheck.errors import ShardcheckError
from shardcheck.harness import collector

# Every subcommand: a module with add_parser(subparsers) and main(args) -> int, in --help's order.
COMMANDS = {"run": run, "report": report_commands, "matrix": matrix, "diff": diff, "simulate": simulate,
            "explore": explore, "releases": releases, "cells": cells}
PASSTHROUGH = {"run": "what follows `--` and the options argparse does not know: pytest's",
               "releases": "what follows `--`: every `shardcheck run`'s arguments"}


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error said in one line (`shardcheck run: argument --x: ...`), exit USAGE."""

    def error(self, message: str):
        self.exit(codes.USAGE, f"{self.prog}: {message} (--help lists the options)\n")


def _versions() -> str:
    """One line: shardcheck's, the installed torch's and Python's versions (torch is not imported)."""
    from importlib import metadata

    def installed(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    return f"shardcheck {installed('shardcheck')} (torch {installed('torch')}, Python {platform.python_version()})"


def parser() -> _Parser:
    """`shardcheck`'s parser: one subparser per entry of COMMANDS."""
    top = _Parser(prog="shardcheck", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    top.add_argument("--version", action="version", version=_versions(),
                     help="shardcheck's, torch's and Python's versions, and exit")
    subparsers = top.add_subparsers(dest="command", required=True)
    for command in COMMANDS.values():
        command.add_parser(subparsers)
    return top


def main(argv: list[str] | None = None) -> int:
    """Parse, dispatch to COMMANDS[command].main(args), and end with its exit status; a ShardcheckError
    that reaches here is one line on stderr (`{args.prog}: {error}`; a command may name itself in
    args.prog) and the status it carries, a Ctrl-C is INTERRUPTED. `args.passthrough` (run, releases:
    PASSTHROUGH) and `args.argv` (the whole command line) are set."""
    argv = sys.argv[1:] if argv is None else argv
    collector.fewer_collections()  # before torch imports (shardcheck/harness/collector.py)
    if argv == ["--version"]:  # answered before the subcommands' parsers, which import torch for their help
        print(_versions())
        return codes.OK
    full_argv, passthrough = list(argv), []
    if "--" in argv:
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1:]
    top = parser()
    args, extra = top.parse_known_args(argv)
    if (extra and args.command != "run") or (passthrough and args.command not in PASSTHROUGH):
        top.error(f"unrecognized arguments: {' '.join(extra + passthrough)}")
    args.passthrough, args.argv, args.prog = extra + passthrough, full_argv, "shardcheck"
    try:
        return COMMANDS[args.command].main(args)
    except ShardcheckError as exc:  # the one place an error of ours becomes a line and an exit status
        print(f"{args.prog}: {exc}", file=sys.stderr)
        return exc.exit_status
    except KeyboardInterrupt:  # a Ctrl-C outside pytest's session: before its first cell, after its report
        print("shardcheck: interrupted", file=sys.stderr)
        return codes.INTERRUPTED


def console_main() -> None:
    """The `shardcheck` console script: main(), one line for a Ctrl-C that came before the run began
    (while torch imports), then the process ends deaf to Ctrl-C (a late one would only print a
    traceback from the interpreter's exit, after the report is written)."""
    try:
        code = main()
    except KeyboardInterrupt:
        print("shardcheck: interrupted", file=sys.stderr)
        code = codes.INTERRUPTED
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(code)


if __name__ == "__main__":
    console_main()
