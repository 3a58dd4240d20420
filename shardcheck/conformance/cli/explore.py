"""`shardcheck explore`: property-based differential checks (shardcheck/conformance/explore/).

    shardcheck explore --impl NAME [--budget SECONDS] [--examples N] [--seed N] [-o REPORT]
    shardcheck explore --replay FILE [--impl NAME]

draws whole training configurations, runs each on the rank pool against unsharded data-parallel
training, shrinks a new failure to a minimal configuration and writes it, with its reproducer, to a
JSON report (and one replay file per finding beside it). Exit code (cli/exit_codes.py): 0 when
nothing new turned up (known findings of the implementation's manifest do not count), 1 on a new
finding (or, with --replay, when the replayed configuration still fails); before anything runs: 2 a
usage error (an option value, hypothesis not installed, a replay file or manifest that cannot be
read), 3 an output path that cannot be written, 4 an unknown implementation, 6 an adapter that
cannot be built.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import sys
import time
from pathlib import Path

from shardcheck.conformance.cli import exit_codes as codes
from shardcheck.conformance.cli.user_code import importable_from_cwd
from shardcheck.errors import UsageError


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("explore", help="draw training configurations (hypothesis), compare each with "
                                       "unsharded data-parallel training, shrink failures")
    p.add_argument("--impl", action="append", help="implementation (repeatable; 'all'); default reference")
    p.add_argument("--budget", type=float, default=120.0, metavar="SECONDS",
                   help="time limit per implementation (default 120)")
    p.add_argument("--examples", type=int, default=1000, metavar="N",
                   help="examples per implementation, shrinking included (default 1000); with a fixed "
                        "--seed the run is deterministic when this, not --budget, ends it")
    p.add_argument("--seed", type=int, default=0, help="hypothesis seed (default 0)")
    p.add_argument("--backend", default="gloo", help="gloo (default) or threaded")
    p.add_argument("--world-sizes", default=None, metavar="1,2,3,4",
                   help="world sizes to draw from (default 1-4 on gloo, 1-8 threaded)")
    p.add_argument("--shrink", type=int, default=150, metavar="N", help="shrinking runs per finding (default 150)")
    p.add_argument("--max-findings", type=int, default=None, metavar="N", help="stop after N new findings")
    p.add_argument("--ignore-known", action="store_true",
                   help="report the manifest's known findings as new (e.g. to rediscover them)")
    p.add_argument("--replay", metavar="FILE", help="run the configuration(s) of a finding file or report")
    p.add_argument("-o", "--output", help="report path (default reports/local/explore-<impl>-<time>-<pid>.json)")


def main(args) -> int:
    from shardcheck.conformance import explore as exploring
    from shardcheck.conformance.adapters import every_builtin, load
    from shardcheck.conformance.report.stream import unwritable

    args.prog = "shardcheck explore"  # its errors' one line (cli/main.py)
    if not exploring.available():
        print(f"shardcheck explore: {exploring.MISSING}", file=sys.stderr)
        return codes.USAGE
    importable_from_cwd()  # --impl my_pkg.adapter:Cls from the project's folder, as run finds it
    sizes = world_sizes(args.world_sizes, args.backend)
    if args.replay:
        return replay(Path(args.replay), args.impl, args.backend)
    names = [n for spec in (args.impl or ["reference"]) for n in (every_builtin()[0] if spec == "all" else [spec])]
    impls = [load(n) for n in names]  # an unknown name, a broken adapter or manifest: its error, its status
    out = Path(args.output or f"reports/local/explore-{'+'.join(names)}-{dt.datetime.now():%Y%m%d-%H%M%S}-{os.getpid()}.json")
    if problem := unwritable(out, stream=False):  # said before exploring, not after it
        print(f"shardcheck: -o/--output: cannot write the report: {problem}", file=sys.stderr)
        return codes.UNWRITABLE
    report = {"kind": "shardcheck-explore", "format": 1, "started": dt.datetime.now(dt.timezone.utc).isoformat(),
              "seed": args.seed, "backend": args.backend, "explore": []}
    new = 0
    for impl in impls:
        result = explore_one(impl, args, sizes)
        report["explore"].append(result_json(result, out))
        new += len(result.findings)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_findings(report, out)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"shardcheck explore: report written to {out}")
    return codes.FAILED if new else codes.OK


def world_sizes(text: str | None, backend: str) -> tuple[int, ...]:
    if not text:
        return tuple(range(1, 9 if backend == "threaded" else 5))
    parts = [s.strip() for s in text.split(",") if s.strip()]
    sizes = tuple(int(s) for s in parts if s.isdigit())
    if not sizes or len(sizes) != len(parts) or min(sizes) < 1:
        raise UsageError(f"--world-sizes {text!r}: positive integers, e.g. 1,2,3,4")
    return sizes


def explore_one(impl, args, sizes):
    """Explore one implementation, printing progress."""
    from shardcheck.conformance.explore.search import Limits, explore

    limits = Limits(max_examples=args.examples, budget_s=args.budget, shrink_examples=args.shrink,
                    max_findings=args.max_findings, world_sizes=sizes, backend=args.backend)
    print(f"shardcheck explore {impl.name}: seed {args.seed}, up to {args.examples} examples or {args.budget:g} s, "
          f"world sizes {','.join(map(str, sizes))}, {args.backend}", flush=True)
    printer = Progress(impl.name)
    result = explore(impl, args.seed, limits, [] if args.ignore_known else None, printer)
    rate = result.examples / result.seconds if result.seconds else 0.0
    known = ", ".join(f"{k} x{v['count']}" for k, v in result.known.items()) or "none"
    print(f"  {impl.name}: {result.examples} examples in {result.seconds:.1f} s ({rate:.1f}/s): "
          f"{result.passed} passed, {result.unsupported} unsupported, {result.failed} failed; known findings: "
          f"{known}; new findings: {len(result.findings)}", flush=True)
    return result


class Progress:
    """One line every 25 examples and at each new finding."""

    def __init__(self, name: str) -> None:
        self.name, self.start = name, time.monotonic()

    def __call__(self, result, event: str) -> None:
        if event == "finding":
            f = result.findings[-1]
            print(f"  NEW FINDING {len(result.findings)} ({self.name}): {f.signature}", flush=True)
        elif result.examples % 25 == 0:
            print(f"  {self.name}: {result.examples} examples, {result.failed} failed "
                  f"({sum(k['count'] for k in result.known.values())} known), {time.monotonic() - self.start:.0f} s",
                  flush=True)


def result_json(result, out: Path) -> dict:
    from shardcheck.conformance.explore.config import to_json

    return {"impl": result.impl, "seed": result.seed, "examples": result.examples, "passed": result.passed,
            "unsupported": result.unsupported, "failed": result.failed, "seconds": round(result.seconds, 2),
            "rounds": result.rounds,
            "known": {k: {**v, "config": to_json(v["config"])} for k, v in result.known.items()},
            "findings": [f.to_json(finding_path(out, result.impl, i)) for i, f in enumerate(result.findings, 1)]}


def finding_path(out: Path, impl: str, index: int) -> Path:
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in impl)
    return out.with_name(f"{out.stem}-{safe}-finding{index}.json")


def write_findings(report: dict, out: Path) -> None:
    """One replay file per finding, beside the report, and the reproducer line printed."""
    for run in report["explore"]:
        for f in run["findings"]:
            doc = {"kind": "shardcheck-explore-finding", **{k: v for k, v in f.items() if k not in ("replay_file", "reproducer")}}
            Path(f["replay_file"]).write_text(json.dumps(doc, indent=1) + "\n")
            print(f"  {run['impl']}: {f['signature']}\n    config: {json.dumps(f['config'], sort_keys=True)}\n"
                  f"    reproduce: {f['reproducer']}")


def replay(path: Path, impls: list[str] | None, backend: str) -> int:
    """Run each configuration of `path` once; exit 1 when one still fails."""
    from shardcheck.conformance.adapters import load
    from shardcheck.conformance.explore.findings import replay_targets
    from shardcheck.conformance.explore.run import run_example

    try:
        targets = replay_targets(path)
    except (OSError, ValueError, KeyError, TypeError) as exc:  # not a finding file or report (JSON included)
        raise UsageError(f"--replay {path}: {exc}") from None
    failing = 0
    for name, config in targets:
        impl = load(impls[0] if impls else name)
        outcome = run_example(impl, config, backend)
        print(f"shardcheck explore --replay {path}: {impl.name}, world size {config.world_size}: {outcome.status}"
              + (f"\n{outcome.message}" if outcome.status == "failed" else ""))
        failing += outcome.status == "failed"
    return codes.FAILED if failing else codes.OK
