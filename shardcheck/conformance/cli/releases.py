"""`shardcheck releases`: judge implementations on several releases of torch (or of any package),
each in its own virtualenv, never touching the environment shardcheck runs from.

    shardcheck releases torch==2.9.1,2.12.1,2.14.1 --impl reference --impl torch-fsdp2
    shardcheck releases accelerate==1.12.0,1.13.0 --impl accelerate -- --world-sizes 2

For every pinned release: a virtualenv under --envs (made once, then reused while its pins are the
same), with that release, the torch of the running environment when the pin is not torch itself,
and this shardcheck (editable from its source checkout, or the same version from the index); then
`shardcheck run` there once per implementation, its report at ``OUT/<package>-<version>/<impl>.json``
(``--prefix P``: ``P<impl>.json``, a second run of other cells beside the first, e.g. the models family:
`shardcheck matrix` joins a release's reports of one implementation into one column).
Arguments after ``--`` go to every `shardcheck run`. uv makes the virtualenvs when it is on PATH
(one download cache for every release), pip otherwise (--installer).

`--split K/N` runs the Kth of N shares of the releases (release i of the list, from 0, in share
i % N + 1): N machines (a job array, a CI matrix) each make their own virtualenvs and reports, and
`shardcheck matrix` reads the reports gathered from all of them (docs/splitting.md). A single run's
cells are split with `-- --split K/N` instead (passed to `shardcheck run`; `shardcheck report merge`).

Exit code (cli/exit_codes.py): the worst of the runs' (0 all passed, 1 a failed cell, 2 a bad pin,
an environment that could not be made or a run that could not start: bad input to `shardcheck run`,
whose own status each run's line shows). It ends with the trend of its own runs (report/trend.py);
`shardcheck matrix OUT/*/*.json` shows the whole trend.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from shardcheck.conformance.cli import exit_codes as codes
from shardcheck.conformance.cli import splitting
from shardcheck.errors import ShardcheckError

DEFAULT_OUT = "reports/releases"
NOT_STARTED = codes.USAGE  # this command's status for a release whose environment or run could not start


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("releases", help="run the matrix on several releases of torch (or of a package), "
                                        "each in its own virtualenv; one report per release and implementation")
    p.add_argument("pins", nargs="+", metavar="PACKAGE==V1,V2,...",
                   help="a package and the releases to judge, e.g. torch==2.9.1,2.14.1 or accelerate==1.13.0")
    p.add_argument("--impl", action="append", help="implementation (repeatable); default reference")
    p.add_argument("--with", dest="extra", action="append", default=[], metavar="REQUIREMENT",
                   help="also install this in every environment (repeatable), e.g. 'deepspeed==0.18.9'")
    p.add_argument("--envs", default=str(Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
                                         / "shardcheck" / "envs"),
                   help="where the virtualenvs live (default ~/.cache/shardcheck/envs)")
    p.add_argument("-o", "--output", default=DEFAULT_OUT, metavar="DIR",
                   help=f"reports go to DIR/<package>-<version>/<impl>.json (default {DEFAULT_OUT})")
    p.add_argument("--prefix", default="", metavar="TEXT",
                   help="reports go to DIR/<package>-<version>/<TEXT><impl>.json: a second run of other cells "
                        "beside a release's first (e.g. --prefix zoo- -- --family models,training_loop); "
                        "shardcheck matrix joins the two by implementation and release")
    p.add_argument("--split", type=splitting.k_of_n, metavar="K/N",
                   help="judge only the Kth of N shares of the releases (release i in share i %% N + 1), "
                        "one share per machine")
    p.add_argument("--installer", choices=("uv", "pip"), default="uv" if shutil.which("uv") else "pip",
                   help="what makes the virtualenvs (default uv when on PATH, else pip)")


def releases(pins: list[str]) -> list[tuple[str, str]]:
    """``["torch==2.9.1,2.14.1"]`` -> ``[("torch", "2.9.1"), ("torch", "2.14.1")]``."""
    out = []
    for pin in pins:
        package, sep, versions = pin.partition("==")
        if not sep or not package.strip() or not versions.strip():
            raise ValueError(f"{pin!r}: expected PACKAGE==V1[,V2...], e.g. torch==2.9.1,2.14.1")
        out += [(package.strip().lower(), v.strip()) for v in versions.split(",") if v.strip()]
    return out


def share(todo: list[tuple[str, str]], k_of_n: str) -> list[tuple[str, str]]:
    """The Kth of N shares of the releases, in their order: release i goes to share i % N + 1."""
    part, of = map(int, k_of_n.split("/"))
    return [release for i, release in enumerate(todo) if i % of == part - 1]


def requirements(package: str, version: str, extra: list[str]) -> list[str]:
    """What one environment installs: the pinned release, the running torch when the pin is another
    package (so its dependencies do not pick a torch of their own), the extras, and shardcheck."""
    import torch

    pins = [f"{package}=={version}"]
    if package != "torch":
        pins.append(f"torch=={torch.__version__.split('+')[0]}")
    return pins + list(extra) + _shardcheck()


def _shardcheck() -> list[str]:
    """This shardcheck: editable from its source checkout, else the same version from the index."""
    from importlib.metadata import version

    root = Path(__file__).resolve().parents[3]
    if (root / "pyproject.toml").is_file() and (root / "shardcheck").is_dir():
        return ["-e", f"{root}[explore]"]
    return [f"shardcheck[explore]=={version('shardcheck')}"]


def _dependencies() -> str:
    """shardcheck's own dependencies, as its metadata states them: an environment made for other
    ones is made again (an editable install does not follow its pyproject.toml)."""
    from importlib.metadata import requires

    return ";".join(sorted(requires("shardcheck") or []))


def environment(envs: Path, package: str, version: str, wanted: list[str], installer: str) -> Path:
    """The virtualenv for one release: reused when it holds the same requirements, else (re)made."""
    env = envs / f"{package}-{version}"
    stamp, made = env / "shardcheck-requirements.json", wanted + [_dependencies()]
    python = env / "bin" / "python"
    if python.exists() and stamp.is_file() and json.loads(stamp.read_text()) == made:
        return env
    if env.exists():
        shutil.rmtree(env)
    if installer == "uv":
        _call(["uv", "venv", "-q", "--python", sys.executable, str(env)])
        _call(["uv", "pip", "install", "-q", "--python", str(python), *wanted])
    else:
        _call([sys.executable, "-m", "venv", str(env)])
        _call([str(python), "-m", "pip", "install", "-q", *wanted])
    stamp.write_text(json.dumps(made))
    return env


class EnvironmentFailed(ShardcheckError):
    """A release's virtualenv that could not be made (the installer's last line)."""


def _call(argv: list[str]) -> None:
    done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode:
        tail = done.stdout.strip().splitlines()[-1:] or ["(no output)"]
        raise EnvironmentFailed(f"`{' '.join(argv[:4])} ...` exited {done.returncode}: {tail[0]}")


def summary(path: Path) -> str:
    """One line from a report: outcome counts and the torch it ran on."""
    report = json.loads(path.read_text())
    counts = report["summary"]["by_outcome"]
    shown = ", ".join(f"{n} {outcome}" for outcome, n in counts.items() if n)
    return f"torch {report['target']['torch']}: {shown}"


def main(args) -> int:
    """args: the parsed options and `passthrough` (what follows `--`: every `shardcheck run`'s arguments)."""
    try:
        todo = releases(args.pins)
    except ValueError as exc:
        print(f"shardcheck releases: {exc}", file=sys.stderr)
        return codes.USAGE
    from shardcheck.conformance.report.stream import unwritable

    if problem := unwritable(Path(args.output) / "probe.json", stream=False):  # before any environment is made
        print(f"shardcheck: -o/--output: cannot write the reports: {problem}", file=sys.stderr)
        return codes.UNWRITABLE
    impls, worst, written = args.impl or ["reference"], codes.OK, []
    if getattr(args, "split", None):
        todo = share(todo, args.split)
        print(f"shardcheck releases: share {args.split}: "
              f"{', '.join(f'{p}=={v}' for p, v in todo) or 'no release (more shares than releases)'}", flush=True)
    print(f"shardcheck releases: {len(todo)} release(s) x {len(impls)} implementation(s); "
          f"virtualenvs in {args.envs} ({args.installer})", flush=True)
    for package, version in todo:
        started = time.monotonic()
        try:
            env = environment(Path(args.envs), package, version,
                              requirements(package, version, args.extra), args.installer)
        except EnvironmentFailed as exc:
            print(f"shardcheck releases: {package}=={version}: no environment: {exc}", file=sys.stderr)
            worst = NOT_STARTED
            continue
        print(f"shardcheck releases: {package}=={version}: environment ready in "
              f"{time.monotonic() - started:.0f} s ({env})", flush=True)
        for impl in impls:
            out = Path(args.output) / f"{package}-{version}" / f"{getattr(args, 'prefix', '')}{impl}.json"
            argv = [str(env / "bin" / "python"), "-m", "shardcheck.conformance.cli", "run", "--impl", impl,
                    "-o", str(out), *args.passthrough]
            out.unlink(missing_ok=True)  # a run that writes none must not be summed up by an earlier one
            code = subprocess.call(argv)
            worst = max(worst, code if code in (codes.OK, codes.FAILED) else NOT_STARTED)
            done = summary(out) if out.is_file() else "no report"
            written += [out] if out.is_file() else []
            print(f"shardcheck releases: {package}=={version} {impl}: exit {code}; {done}; {out}", flush=True)
    print_trend(written)
    print(f"shardcheck releases: the whole trend: shardcheck matrix {args.output}/*/*.json", flush=True)
    return worst


def print_trend(paths: list[Path]) -> None:
    """The "Across releases" tables of this run's reports (shardcheck.conformance.report.trend)."""
    from shardcheck.conformance.report import matrix, trend
    from shardcheck.conformance.report.reading import ReportError, load

    try:
        reports = [load(path) for path in paths]
    except ReportError as exc:
        print(f"shardcheck releases: no trend: {exc}", file=sys.stderr)
        return
    across = trend.by_release(matrix.merge(reports), matrix.column_sources(reports))
    if trend.spans_releases(across):
        print("\n".join(trend.markdown(across)), flush=True)
