"""`shardcheck run --model pkg.module:factory [--batches pkg.module:fn] [--wrap CLASS,...]`: the
user's own model in the family models (shardcheck/conformance/checks/support/own_model.py), checked
here before any cell runs: bad input is one line and the usage status."""

from __future__ import annotations

import sys

from shardcheck.conformance.cli import exit_codes as codes


def add_arguments(run) -> None:
    run.add_argument("--model", action="append", metavar="PKG.MODULE:FACTORY",
                     help="your own model (repeatable): FACTORY() returns an nn.Module; the family models "
                          "judges it on every selected implementation (docs/models.md). Alone, --model "
                          "selects the family models")
    run.add_argument("--batches", metavar="PKG.MODULE:FN",
                     help="FN(rank, step) -> (inputs, targets) for --model (default: drawn from its first module)")
    run.add_argument("--wrap", metavar="CLASS[,CLASS]",
                     help="the module classes sharded as units for --model (default: transformers' "
                          "_no_split_modules, else the repeated block)")


def pytest_args(args) -> list[str] | int:
    """The `--shardcheck-model` options for `args.model`, or the usage status after one line on stderr."""
    if not args.model:
        if args.batches or args.wrap:
            print("shardcheck: --batches and --wrap describe a --model; give one", file=sys.stderr)
            return codes.USAGE
        return []
    from shardcheck.conformance.checks.support.own_model import OwnModel, problem

    out = []
    for factory in args.model:
        text = str(OwnModel(factory, args.batches, tuple(c for c in (args.wrap or "").split(",") if c)))
        if (why := problem(text)) is not None:
            print(f"shardcheck: --model {factory}: {why}", file=sys.stderr)
            return codes.USAGE
        out.append(f"--shardcheck-model={text}")
    return out
