"""`shardcheck`: the command-line entry point.

    shardcheck run [--impl NAME]... [--backend gloo|threaded|nccl] [--world-sizes 2,4]
                   [--family clip_grad,...] [-k EXPR] [-o REPORT] [-- pytest args]

runs the conformance matrix through pytest (the checks are pytest tests) and writes a JSON report.
Exit code: 0 when no cell failed, 1 otherwise (pytest's codes for usage errors pass through).
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path

import pytest

CHECKS = Path(__file__).parent / "checks"
FAMILIES = ("clip_grad", "grad_scaler", "extensions", "comm_hooks")


def _run(args, passthrough: list[str]) -> int:
    families = args.family.split(",") if args.family else list(FAMILIES)
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        print(f"shardcheck: unknown family {', '.join(unknown)}; choose from {', '.join(FAMILIES)}",
              file=sys.stderr)
        return 4
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.output or f"reports/local/{'+'.join(args.impl or ['reference'])}-{args.backend}-{stamp}.json")
    argv = [str(CHECKS / f"test_{f}.py") for f in families if (CHECKS / f"test_{f}.py").exists()]
    argv += ["-p", "no:cacheprovider", "--backend", args.backend, "--shardcheck-report", str(out),
             "-o", "addopts=", "-q", "-rfEU"]
    for impl in args.impl or []:
        argv += ["--impl", impl]
    if args.world_sizes:
        argv += ["--world-sizes", args.world_sizes]
    if args.k:
        argv += ["-k", args.k]
    code = pytest.main(argv + passthrough)
    if out.exists():
        print(f"shardcheck: report written to {out}")
    return int(code)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    passthrough = []
    if "--" in argv:
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(prog="shardcheck", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the conformance matrix and write a JSON report")
    run.add_argument("--impl", action="append", help="implementation (repeatable); default reference")
    run.add_argument("--backend", default="gloo", help="gloo (default), threaded or nccl")
    run.add_argument("--world-sizes", help="comma-separated world sizes to keep, e.g. 2,4")
    run.add_argument("--family", help=f"comma-separated check families: {', '.join(FAMILIES)}")
    run.add_argument("-k", help="pytest -k expression selecting cells")
    run.add_argument("-o", "--output", help="report path (default reports/local/<impl>-<backend>-<time>.json)")
    args, extra = parser.parse_known_args(argv)
    return _run(args, extra + passthrough)


if __name__ == "__main__":
    sys.exit(main())
