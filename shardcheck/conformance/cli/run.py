"""`shardcheck run`: the conformance matrix through pytest, in this process, and its JSON report.

    shardcheck run [--impl NAME]... [--backend gloo|threaded|nccl] [--world-sizes 2,4]
                   [--family clip_grad,...] [-k EXPR] [-o REPORT] [--min-coverage PCT]
                   [--split K/N [--durations REPORT...]] [-- pytest args]

Bad input (an unknown family or implementation, an adapter that cannot be built, a report path that
cannot be written, --model, --split and --durations values) is one line on stderr and its exit
status (cli/exit_codes.py), checked before any cell runs, leaving no file behind. Then pytest runs
the cells with cli/progress.RunProgress as an extra plugin; pytest's own exit status is turned into
the command's (exit_codes.of_pytest), and an interrupted run says whether its report is complete.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

from shardcheck.conformance.checks import DEFAULT_FAMILIES, FAMILIES, OPT_IN
from shardcheck.conformance.cli import exit_codes as codes
from shardcheck.conformance.cli import interrupts, own_model, splitting
from shardcheck.conformance.cli.user_code import importable_from_cwd
from shardcheck.conformance.expectations import judged_releases
from shardcheck.errors import UnknownName
from shardcheck.pytest_plugin import RANK_TIMEOUT_S

CHECKS = Path(__file__).parents[1] / "checks"
MAX_AUTO_WORKERS = 4


def add_parser(subparsers) -> None:
    run = subparsers.add_parser("run", help="run the conformance matrix and write a JSON report")
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


def main(args) -> int:
    """args: the parsed options, `passthrough` (what follows `--` and what argparse did not know: pytest's)
    and `argv` (the whole command line, for the torchrun relaunch)."""
    importable_from_cwd()  # --impl my_pkg.adapter:Cls and --model my_pkg.models:build from the project's folder
    models = own_model.pytest_args(args)
    if isinstance(models, int):
        return models
    if models:  # the user's models alone: not the zoo's other cells (the bf16 load of Llama)
        args.k = f"test_model_parity and ({args.k})" if args.k else "test_model_parity"
    families = args.family.split(",") if args.family else ["models"] if models else list(DEFAULT_FAMILIES)
    if unknown := sorted(set(families) - set(FAMILIES)):
        raise UnknownName(f"unknown family {', '.join(unknown)}; choose from {', '.join(FAMILIES)}")
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
    if note := judged_releases.unjudged(judged_releases.installed_torch(), args.impl or ["reference"]):
        print(f"shardcheck: {note}", file=sys.stderr)  # runs all the same, saying so first
    load_each(args.impl or [])
    if refused := splitting.refused(args):
        return refused
    made = [p for p in out.parents if not p.exists()]  # the run's own folders, deepest first
    if writes_report and (problem := reporting.unwritable(out)):
        print(f"shardcheck: -o/--output: cannot write the report: {problem}", file=sys.stderr)
        return codes.UNWRITABLE
    argv = pytest_argv(args, families, models, out)
    workers = workers_for(args, launch, args.passthrough) if args.workers == "auto" else args.workers
    if workers:
        argv += ["-n", str(workers)]
    if args.launcher == "torchrun":  # re-run this command on ranks started by torchrun: its status is ours
        return subprocess.call([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                "--nproc-per-node", str(args.nproc_per_node), "-m", "shardcheck.conformance.cli",
                                *_without_launcher(args.argv)])
    code = _judge(args, launch, argv, out, writes_report, made)
    if launch is not None:  # a launcher's rank: everything is written; leave before C++'s teardown
        sys.stdout.flush()
        sys.stderr.flush()
        # gloo's threads met at interpreter exit aborted a torchrun rank after its last cell passed
        # ("terminate called without an active exception", no Python frame: about 1 run in 50 under load)
        os._exit(code)
    return code


def _judge(args, launch, argv: list[str], out: Path, writes_report: bool, made: list[Path]) -> int:
    """The pytest session, its summary and the run's exit status."""
    import pytest

    from shardcheck.conformance.report import writer as reporting

    if launch is not None and launch.rank != 0:  # only rank 0 shows progress and writes the report
        return codes.of_pytest(pytest.main(argv + args.passthrough))
    code, progress = _session(argv + args.passthrough, out, writes_report)
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


def pytest_argv(args, families: list[str], models: list[str], out: Path) -> list[str]:
    """pytest's command line for the selected cells, the report at `out` (workers and `--` args aside)."""
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
    argv += [f"--shardcheck-impl={impl}" for impl in args.impl or []]
    if args.world_sizes:
        argv += [f"--shardcheck-world-sizes={args.world_sizes}"]
    if args.k:
        argv += ["-k", args.k]
    argv += splitting.pytest_args(args)  # --split K/N: part K of the cells selected so far
    if args.rank_timeout:
        argv += [f"--shardcheck-rank-timeout={args.rank_timeout:g}"]
    return argv


def _session(argv: list[str], out: Path, writes_report: bool):
    """pytest.main with the progress display, and the run's last words: (pytest's code, the progress)."""
    import pytest

    from shardcheck.conformance.cli.progress import RunProgress  # rich: only for this command

    progress = RunProgress()
    before = out.stat().st_mtime_ns if out.is_file() else None
    with interrupts.watching() as watch, progress.watching_waits():
        try:
            code = pytest.main(argv, plugins=[progress])
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
    return code, progress


def load_each(impls: list[str]) -> None:
    """Each --impl loaded before pytest starts (a comma-separated one name by name; `all`, the
    built-ins, is the selection plugin's): an unknown name or a broken adapter module raises its
    error (UnknownAdapter, AdapterImportError) with its exit status, not a usage error deep in a session."""
    from shardcheck.conformance import adapters

    for impl in impls:
        for name in impl.split(","):
            if name.strip() and name.strip() != "all":
                adapters.load(name.strip())


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
