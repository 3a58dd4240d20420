"""The `shardcheck simulate` subcommand: arguments, JSON report, human summary, exit code.

    shardcheck simulate --impl reference --world-size 1024 --model transformer-1b [-o REPORT.json]
                        [--mesh RxS] [--rank R]... [--step classes|all|first|none]
    shardcheck simulate --impl reference --world-size 16384 --mesh 128x128 --model llama3-405b

Exit code: 0 when every verdict cell passed, 1 when one failed, 2 on bad input.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def add_parser(sub) -> None:
    from .impls import SIMULATORS
    from .presets import PRESETS
    from .runner import STEP_MODES

    p = sub.add_parser("simulate", help="check shard shapes, bytes per rank and collectives at a large "
                                        "world size, in one process (fake process group, meta tensors)")
    p.add_argument("--impl", default="reference", help=f"implementation: {', '.join(SIMULATORS)} (default reference)")
    p.add_argument("--world-size", type=int, required=True, help="simulated world size, e.g. 1024")
    p.add_argument("--mesh", metavar="RxS",
                   help="2-D (replicate, shard) mesh with R * S = world size, e.g. 128x128: HYBRID_SHARD "
                        "(shard within a replica group, replicate across); default 1-D FULL_SHARD")
    p.add_argument("--model", default="transformer-1b", help=f"model preset: {', '.join(PRESETS)}")
    p.add_argument("--rank", type=int, action="append", dest="ranks",
                   help="rank to simulate (repeatable; default: both ends of every class of shard ranks "
                        "that hold alike, in the first and the last replica; the rest are checked by arithmetic)")
    p.add_argument("--step", choices=STEP_MODES, default="classes",
                   help="simulated ranks that run one forward + backward (default classes: the first "
                        "simulated rank of every class, and the last if in another replica)")
    p.add_argument("-o", "--output", help="write the JSON report here")


def main(args) -> int:
    from .runner import human_summary, simulate

    try:
        report = simulate(args.impl, args.world_size, args.model, args.ranks, args.step, args.mesh)
    except ValueError as exc:
        print(f"shardcheck: {exc}", file=sys.stderr)
        return 2
    print(human_summary(report))
    if args.output:
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"shardcheck: report written to {out}")
    return 1 if report["summary"]["failed"] else 0
