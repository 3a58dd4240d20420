"""`shardcheck`: the command-line entry point.

    shardcheck run [--impl NAME]... [--backend gloo|threaded|nccl] [--world-sizes 2,4]
                   [--family clip_grad,...] [-k EXPR] [-o REPORT] [--min-coverage PCT]
                   [--split K/N [--durations REPORT...]] [-- pytest args]

runs the conformance matrix through pytest (the checks are pytest tests) and writes a JSON report,
with a progress bar on a terminal (plain progress lines elsewhere), a families x outcomes table and
coverage (cells that reached a verdict / cells collected) and conformance (passed / judged: the known
failures that are by design, platform or misuse set aside, docs/findings.md) per implementation and layer. Exit code (shardcheck/conformance/cli/exit_codes.py): 0 when no cell failed or errored
(xfailed and unsupported cells do not count) and every implementation's coverage is at least
--min-coverage (default 0: off, since an implementation without FSDP-style APIs legitimately reaches
few api cells; CI should set it), 1 otherwise; 2 a bad option value; 3 an output path that cannot be
written; 4 an unknown name; 5 no cell selected; 6 an adapter module that raised at import; 130
interrupted (Ctrl-C, however many: its report says complete: false). Bad input is one line on
stderr, checked before any cell runs, and leaves no file behind. A whole matrix runs on pytest-xdist
workers, one per core (`--workers N` sets it, 0 for this process alone; a selection runs here).

    shardcheck report assemble REPORT.jsonl [-o REPORT.json]
    shardcheck report upgrade REPORT.json [-o OUT.json]
    shardcheck report merge PART... -o OUT.json

rebuild the report from the cells a run streamed, e.g. after a crash (`complete: false`), rewrite
a report of an earlier schema version as the current one (in place by default), saying its size before and after,
and join the reports of `run --split 1/N` ... `N/N` into one (cli/splitting.py; exit 7: a part missing or repeated).

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
import contextlib
import datetime as dt
import importlib.util
import os
import platform
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from shardcheck.conformance.checks import DEFAULT_FAMILIES, FAMILIES, OPT_IN
from shardcheck.conformance.cli import explore as explore_command
from shardcheck.conformance.cli import exit_codes as codes
from shardcheck.conformance.cli import cells, interrupts, matrix_commands, own_model, report_commands, splitting
from shardcheck.conformance.cli import releases as releases_command
from shardcheck.conformance.expectations import releases
from shardcheck.harness import collector
from shardcheck.pytest_plugin import RANK_TIMEOUT_S

CHECKS = Path(__file__).parents[1] / "checks"


def _run(args, passthrough: list[str]) -> int:
    _importable_from_cwd()  # --impl my_pkg.adapter:Cls and --model my_pkg.models:build from the project's folder
    models = own_model.pytest_args(args)
    if isinstance(models, int):
        return models
    if models:  # the user's models alone: not the zoo's other cells (the bf16 load of Llama)
        args.k = f"test_model_parity and ({args.k})" if args.k else "test_model_parity"
    families = args.family.split(",") if args.family else ["models"] if models else list(DEFAULT_FAMILIES)
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        print(f"shardcheck: unknown family {', '.join(unknown)}; choose from {', '.join(FAMILIES)}",
              file=sys.stderr)
        return codes.UNKNOWN_NAME
    stamp = f"{dt.datetime.now():%Y%m%d-%H%M%S}-{os.getpid()}"  # two runs in one second: two files
    # a file name any filesystem and shell takes: pkg.mod:Cls -> pkg.mod_Cls, torch-fsdp1[flat] -> torch-fsdp1_flat_
    named = re.sub(r"[^\w.+-]", "_", "+".join(args.impl or ["reference"]))
    out = Path(args.output or f"reports/local/{named}-{args.backend}-{stamp}.json")
    from shardcheck.conformance.report import writer as reporting
    from shardcheck.harness.launcher import detect

    launch = detect()
    # Checked where the report is written: here, or on a launcher's rank 0 alone (another rank's
    # check would race with rank 0's lock on the stream, or unlink the file rank 0 just created).
    writes_report = args.launcher == "none" and (launch is None or launch.rank == 0)
    if note := releases.unjudged(releases.installed_torch(), args.impl or ["reference"]):
        print(f"shardcheck: {note}", file=sys.stderr)  # runs all the same, saying so first
    refused = _unloadable(args.impl or []) or splitting.refused(args)
    if refused:
        return refused
    made = [p for p in out.parents if not p.exists()]  # the run's own folders, deepest first
    problem = reporting.unwritable(out) if writes_report else None
    if problem:
        print(f"shardcheck: -o/--output: cannot write the report: {problem}", file=sys.stderr)
        return codes.UNWRITABLE
    argv = sorted(str(p) for f in families for p in CHECKS.rglob(f"test_{f}*.py"))
    argv += ["-p", "no:cacheprovider", f"--shardcheck-backend={args.backend}",
             f"--shardcheck-report={out}",  # one token: pytest never takes an existing report for a test path
             "-o", "addopts=", "-o", "console_output_style=classic", "-q", "-rfEU",
             "-W", "ignore::pytest.PytestAssertRewriteWarning",  # conformance is imported before pytest
             # hypothesis's pytest plugin is for @given tests (explore drives hypothesis through its
             # API), and imports all of hypothesis at the end of every session: ~1 s of CPU where
             # bytecode is not cached (pytest rewrites a plugin's modules)
             "-p", "no:hypothesispytest"]
    argv += models
    for impl in args.impl or []:
        argv += [f"--shardcheck-impl={impl}"]
    if args.world_sizes:
        argv += [f"--shardcheck-world-sizes={args.world_sizes}"]
    if args.k:
        argv += ["-k", args.k]
    argv += splitting.pytest_args(args)  # --split K/N: part K of the cells selected so far
    if args.rank_timeout:
        argv += [f"--shardcheck-rank-timeout={args.rank_timeout:g}"]
    workers = workers_for(args, launch, passthrough) if args.workers == "auto" else args.workers
    if workers:
        argv += ["-n", str(workers)]
    if args.launcher == "torchrun":  # re-run this command on ranks started by torchrun
        return subprocess.call([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                "--nproc-per-node", str(args.nproc_per_node), "-m", "shardcheck.conformance.cli",
                                *_without_launcher(args.argv)])
    if launch is not None and launch.rank != 0:  # only rank 0 shows progress and writes the report
        return int(pytest.main(argv + passthrough))
    from shardcheck.conformance.cli.progress import RunProgress  # rich: only for this command

    progress = RunProgress()
    before = out.stat().st_mtime_ns if out.is_file() else None
    with interrupts.watching() as watch, progress.watching_waits():
        try:
            code = pytest.main(argv + passthrough, plugins=[progress])
        except KeyboardInterrupt:  # a second Ctrl-C inside pytest's own handling of the first
            code = pytest.ExitCode.INTERRUPTED
        except Exception:  # pytest's handling of a Ctrl-C failed in turn (a frame caught mid-line)
            if not watch.seen:
                raise
            code = pytest.ExitCode.INTERRUPTED
        finally:
            progress.stop()
    with interrupts.no_interrupts():
        if code == pytest.ExitCode.INTERRUPTED and writes_report:
            interrupts.assemble_if_unwritten(out, before)
        if progress.n_done:
            progress.print_summary()
        if out.is_file() and out.stat().st_mtime_ns != before:
            print(f"shardcheck: report written to {out}")
    if code == pytest.ExitCode.INTERRUPTED:
        print(f"shardcheck: interrupted{interrupts.completeness(out) if writes_report else ''}", file=sys.stderr)
        return codes.INTERRUPTED
    if code == pytest.ExitCode.NO_TESTS_COLLECTED and args.split and writes_report and (note := splitting.empty_part(out)):
        print(note)  # more parts than cells: an empty part's report, for the merge
        return codes.OK
    if code == pytest.ExitCode.NO_TESTS_COLLECTED:
        for path in (out, reporting.stream_path(out)) if writes_report else ():
            path.unlink(missing_ok=True)  # a report of no cell says nothing
        for folder in made if writes_report else ():
            with contextlib.suppress(OSError):  # a folder someone else wrote into meanwhile stays
                folder.rmdir()
        print("shardcheck: no cell selected: --family, --world-sizes, -k and --impl left none (no report written)",
              file=sys.stderr)
        return codes.NO_CELL
    return progress.exit_code(code, args.min_coverage)


def _unloadable(impls: list[str]) -> int:
    """Each --impl loaded before pytest starts: an unknown name or a broken adapter module is one
    line and its own exit status (exit_codes), not a usage error deep in a session. 0: all load."""
    from shardcheck.conformance import adapters

    for impl in impls:
        if impl == "all" or "," in impl:
            continue  # names the selection plugin expands or splits itself
        try:
            adapters.load(impl)
        except adapters.UnknownAdapter as exc:
            print(f"shardcheck: {exc}", file=sys.stderr)
            return codes.ADAPTER_IMPORT if isinstance(exc, adapters.AdapterImportError) else codes.UNKNOWN_NAME
    return 0


def _importable_from_cwd() -> None:
    """The working folder first on the import path, here and in pytest-xdist's workers (PYTHONPATH):
    a console script, unlike `python -m`, does not put it there."""
    if (cwd := os.getcwd()) not in sys.path:
        sys.path.insert(0, cwd)
    if cwd not in (paths := os.environ.get("PYTHONPATH", "").split(os.pathsep)):
        os.environ["PYTHONPATH"] = os.pathsep.join([cwd, *filter(None, paths)])


MAX_AUTO_WORKERS = 4


def workers_for(args, launch, passthrough: list[str]) -> int:
    """`--workers auto`: one pytest-xdist worker per core (at most MAX_AUTO_WORKERS; with several
    implementations at most one each) for several implementations or one's whole matrix: cells at
    world size 1, or waiting on gloo, leave a core idle that another worker fills (2 cores: the six
    built-in implementations 441 s -> 297 s; the reference's 583 cells 56-59 s -> 47-49 s). Else 0
    (in this process): a selection of one implementation's cells (--family, --world-sizes, -k: the
    workers' start-up outweighs them), a launcher's ranks, nccl (`-- -n gpus` leases the GPUs), `-n`
    after `--`, or no pytest-xdist."""
    impls = args.impl or ["reference"]
    several = len(impls) > 1 or "all" in impls
    selection = args.family or args.world_sizes or args.k
    if ((not several and selection) or args.launcher != "none" or launch is not None
            or args.backend == "nccl" or "no:xdist" in passthrough
            or any(a.startswith(("-n", "--numprocesses")) for a in passthrough)):
        return 0
    if importlib.util.find_spec("xdist") is None:  # the test extra installs it
        return 0
    one_per_impl = MAX_AUTO_WORKERS if "all" in impls or not several else len(impls)
    return min(os.cpu_count() or 1, MAX_AUTO_WORKERS, one_per_impl)


def _workers(text: str) -> str | int:
    if text != "auto" and not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is neither a number of workers nor 'auto'")
    if text not in ("auto", "0") and importlib.util.find_spec("xdist") is None:
        raise argparse.ArgumentTypeError(f"{text} workers need pytest-xdist (pip install pytest-xdist, or the test extra)")
    return text if text == "auto" else int(text)


def _without_launcher(argv: list[str]) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--launcher", "--nproc-per-node"):
            skip = True
        elif not arg.startswith(("--launcher=", "--nproc-per-node=")):
            out.append(arg)
    return out


def _impl_name(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("empty implementation name (e.g. --impl torch-fsdp2)")
    return text


def _world_sizes(text: str) -> str:
    sizes = [s.strip() for s in text.split(",")]
    if not all(s.isdigit() and int(s) > 0 for s in sizes):
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of positive integers "
                                         "(e.g. 2,4)")
    return ",".join(sizes)


def _percent(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 100:
        raise argparse.ArgumentTypeError(f"{text!r} is not a percentage from 0 to 100")
    return value


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error said in one line (`shardcheck run: argument --x: ...`), exit 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (--help lists the options)\n")


def _versions() -> str:
    """One line: shardcheck's, the installed torch's and Python's versions (torch is not imported)."""
    from importlib import metadata

    def installed(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    return f"shardcheck {installed('shardcheck')} (torch {installed('torch')}, Python {platform.python_version()})"


def _simulate(args, extra: list[str]) -> int:
    from shardcheck.conformance.simulate import (
        command,  # torch.distributed fake group: only for this command
    )

    if extra:
        print(f"shardcheck: unrecognized arguments: {' '.join(extra)}", file=sys.stderr)
        return 2
    _importable_from_cwd()  # --impl my_pkg.adapter:Cls from the project's folder, as run finds it
    return command.main(args)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    collector.fewer_collections()  # before torch imports (shardcheck/harness/collector.py)
    if argv == ["--version"]:  # answered before the subcommands' parsers, which import torch for their help
        print(_versions())
        return 0
    full_argv = list(argv)
    passthrough = []
    if "--" in argv:
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1:]
    parser = _Parser(prog="shardcheck", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=_versions(),
                        help="shardcheck's, torch's and Python's versions, and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the conformance matrix and write a JSON report")
    run.add_argument("--impl", action="append", type=_impl_name,
                     help="implementation (repeatable); default reference")
    run.add_argument("--backend", default="gloo", help="gloo (default), threaded or nccl")
    run.add_argument("--world-sizes", type=_world_sizes, help="comma-separated world sizes to keep, e.g. 2,4")
    run.add_argument("--family", help=f"comma-separated check families: {', '.join(FAMILIES)} (default: all "
                                      f"but {', '.join(OPT_IN)})")
    run.add_argument("-k", help="pytest -k expression selecting cells")
    run.add_argument("--rank-timeout", type=float, metavar="SECONDS",
                     help="a cell's deadline: a rank still running then fails the cell with its stack "
                          f"(default {RANK_TIMEOUT_S:g}; the pytest option --shardcheck-rank-timeout); "
                          "while a rank is overdue the progress line names the cell and the rank")
    run.add_argument("-o", "--output",
                     help="report path (default reports/local/<impl>-<backend>-<time>-<pid>.json)")
    run.add_argument("--min-coverage", type=_percent, default=0.0, metavar="PCT",
                     help="fail the run when an implementation's coverage (cells that reached a verdict "
                          "/ cells collected, all layers) is below PCT percent (default 0: off)")
    run.add_argument("--workers", type=_workers, default="auto", metavar="N|auto",
                     help="pytest-xdist workers; 0: in this process; auto (default): one per core (at most "
                          f"{MAX_AUTO_WORKERS}) for several implementations or a whole matrix, else 0")
    run.add_argument("--launcher", choices=("none", "torchrun"), default="none",
                     help="torchrun: run the matrix on ranks started by torchrun --standalone "
                          "(multi-node: start `torchrun ... -m shardcheck.conformance.cli run` yourself)")
    run.add_argument("--nproc-per-node", type=int, default=2, help="ranks for --launcher torchrun")
    own_model.add_arguments(run)
    splitting.add_arguments(run)
    report_commands.add_parser(sub)
    from shardcheck.conformance.simulate import command as simulate_command
    simulate_command.add_parser(sub)
    for command in (matrix_commands, explore_command, releases_command, cells):
        command.add_parser(sub)
    args, extra = parser.parse_known_args(argv)
    args.argv = full_argv
    if args.command == "simulate":
        return _simulate(args, extra + passthrough)
    if args.command != "run" and (extra or (passthrough and args.command != "releases")):
        parser.error(f"unrecognized arguments: {' '.join(extra + passthrough)}")
    if args.command in ("matrix", "diff"):
        return matrix_commands.main(args)
    if args.command == "report":
        return report_commands.main(args)
    if args.command in ("explore", "releases", "cells"):
        return releases_command.main(args, passthrough) if args.command == "releases" else \
            {"explore": explore_command, "cells": cells}[args.command].main(args)
    try:
        return _run(args, extra + passthrough)
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
