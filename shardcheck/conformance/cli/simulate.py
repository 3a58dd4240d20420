"""The `shardcheck simulate` subcommand: arguments, JSON report, human summary, exit code.

    shardcheck simulate --impl reference --world-size 1024 --model transformer-1b [-o REPORT.json]
                        [--mesh RxS] [--rank R]... [--step classes|all|first|none]
    shardcheck simulate --impl reference --world-size 16384 --mesh 128x128 --model llama3-405b
    shardcheck simulate --impl torch-fsdp1 --world-size 1024 --model transformer-1b   # any adapter

`reference` and `torch-fsdp2` are also checked parameter by parameter (shard shapes, padding, the
collectives' groups: shard_layouts.py, which reads their layouts); every registered implementation, those two
included with `--trainer`, runs through its own trainer, measured and judged like the family sharding
(trainers.py).

Exit code (cli/exit_codes.py): 0 when every verdict cell passed, 1 when one failed; bad input, before
anything is simulated: 2 an option value (world size, rank, mesh), 3 an output path that cannot be
written, 4 an unknown implementation or model preset, 6 an adapter that cannot be built.
The simulation's modules are in shardcheck/conformance/simulate/.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from shardcheck.conformance.cli import exit_codes as codes
from shardcheck.conformance.cli.user_code import importable_from_cwd
from shardcheck.errors import ShardcheckError, UsageError


def add_parser(subparsers) -> None:
    from shardcheck.conformance.simulate.options import LAYOUT_CHECKED, PRESETS, STEP_MODES

    p = subparsers.add_parser("simulate", help="check shard shapes, bytes per rank and collectives at a large "
                                        "world size, on this machine (fake process group, meta tensors; a process per simulated rank)")
    p.add_argument("--impl", default="reference",
                   help=f"any registered implementation (default reference); {', '.join(LAYOUT_CHECKED)} are also "
                        "checked parameter by parameter")
    p.add_argument("--trainer", action="store_true",
                   help="simulate through the implementation's trainer (the default for all but "
                        f"{', '.join(LAYOUT_CHECKED)}): memory by kind and traffic against FULL_SHARD's promise")
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
    from shardcheck.conformance.report.stream import unwritable

    problem = unwritable(Path(args.output), stream=False) if args.output else None
    if problem:  # said before the simulation, not after it
        print(f"shardcheck: -o/--output: cannot write the report: {problem}", file=sys.stderr)
        return codes.UNWRITABLE
    importable_from_cwd()  # --impl my_pkg.adapter:Cls from the project's folder, as run finds it
    from shardcheck.conformance.simulate import shard_layouts, trainers  # torch's fake process group: only here
    from shardcheck.conformance.simulate.impls import SIMULATORS

    through_trainer = args.trainer or args.impl not in SIMULATORS
    try:
        if through_trainer:
            report = trainers.simulate(args.impl, args.world_size, args.model, args.ranks, args.mesh)
        else:
            report = shard_layouts.simulate(args.impl, args.world_size, args.model, args.ranks, args.step, args.mesh)
    except ShardcheckError:
        raise  # ours (an unknown implementation or preset): its own status
    except (ValueError, ImportError) as exc:  # an option value the simulation refuses: a usage error
        raise UsageError(str(exc)) from None
    print((trainers if through_trainer else shard_layouts).human_summary(report))
    if args.output:
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"shardcheck: report written to {out}")
    return codes.FAILED if report["summary"]["failed"] else codes.OK
