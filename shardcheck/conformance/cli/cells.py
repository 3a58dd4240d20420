"""`shardcheck cells`: the cells a declaration reaches, without running one.

    shardcheck cells --impl NAME [--family F,...] [--world-sizes 2,4]

collects the matrix for the adapter (pytest's collection, in this process: no rank starts) and
reads each cell's `requires` (the capabilities it needs, plugins/selection.py). It prints,
per family, the cells collected and those the declaration reaches (every capability a cell needs is
declared; the others are unsupported), and the reached ones by strategy; then each capability the
adapter does not declare with the cells declaring it alone would add, and the declared capabilities
that reach no cell by themselves being declared (every cell needing one also needs something
undeclared). Exit 0; 4 an unknown name (implementation, variant, capability, family); 6 an adapter
that cannot be built (cli/exit_codes.py).
"""

from __future__ import annotations

import contextlib
import io
from collections import Counter, defaultdict

from shardcheck.conformance.cli import exit_codes as codes
from shardcheck.conformance.cli.user_code import importable_from_cwd
from shardcheck.errors import UnknownName

STRATEGY_CAPABILITIES = ("full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "shard_optimizer")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("cells", help="the cells an adapter's declaration reaches, per family, strategy and "
                                     "capability, and what each undeclared capability would add")
    p.add_argument("--impl", required=True, help="implementation (a built-in name, name[variant] or pkg.module:attr)")
    p.add_argument("--family", help="comma-separated check families (default: all)")
    p.add_argument("--world-sizes", help="comma-separated world sizes to keep, e.g. 2,4")


class _Collected:
    """A pytest plugin keeping the collected items: (family, needed capabilities) per cell."""

    def __init__(self) -> None:
        self.cells: list[tuple[str, frozenset]] = []

    def pytest_collection_finish(self, session) -> None:
        from pathlib import Path

        from shardcheck.conformance.checks import family_of_file
        from shardcheck.conformance.plugins.selection import required_capabilities

        for item in session.items:
            if getattr(item, "callspec", None) and "impl" in item.callspec.params:
                family = family_of_file(Path(str(item.fspath)).stem)
                self.cells.append((family, frozenset(required_capabilities(item))))


def collect(impl: str, families, world_sizes: str | None) -> list[tuple[str, frozenset]]:
    """(family, capabilities needed) of every cell of `families` for `impl`."""
    import pytest

    from shardcheck.conformance.checks import files_of

    argv = [str(p) for p in files_of(families)] + [
        "--collect-only", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-p", "no:hypothesispytest",
        f"--shardcheck-impl={impl}", "-W", "ignore::pytest.PytestAssertRewriteWarning"]
    if world_sizes:
        argv.append(f"--shardcheck-world-sizes={world_sizes}")
    plugin = _Collected()
    with contextlib.redirect_stdout(io.StringIO()) as out:
        code = pytest.main(argv, plugins=[plugin])
    if code not in (0, 5):
        raise RuntimeError(f"collecting the cells failed (pytest exit {int(code)}):\n{out.getvalue()[-2000:]}")
    return plugin.cells


def table(adapter, cells) -> list[str]:
    """The lines `shardcheck cells` prints for `adapter` over `cells` ((family, needed) pairs)."""
    declared = set(adapter.capabilities)
    reached = [(f, n) for f, n in cells if n <= declared]
    lines = [f"{adapter.name}: {len(reached)} of {len(cells)} cells reached "
             f"({100 * len(reached) / max(len(cells), 1):.1f}%)", "",
             f"{'family':<15} {'cells':>6} {'reached':>8}  reached by strategy"]
    by_family: dict[str, list] = defaultdict(list)
    for f, n in cells:
        by_family[f].append(n)
    for family, needs in by_family.items():
        ok = [n for n in needs if n <= declared]
        strategies = Counter(next((s.upper() for s in STRATEGY_CAPABILITIES if s in n), "-") for n in ok)
        lines.append(f"{family:<15} {len(needs):>6} {len(ok):>8}  "
                     + ", ".join(f"{s} {k}" for s, k in sorted(strategies.items())))
    gains = Counter(next(iter(n - declared)) for _, n in cells if len(n - declared) == 1)
    lines += ["", "capabilities not declared, and the cells declaring each alone would add:"]
    lines += [f"  {c:<26} +{k}" for c, k in gains.most_common()] or ["  (none would add a cell alone)"]
    used = set().union(*(n for _, n in reached)) if reached else set()
    idle = sorted(declared - used)
    lines += ["", "declared, reaching no cell (every cell needing it also needs an undeclared capability):",
              "  " + (", ".join(idle) if idle else "(none)")]
    return lines


def main(args) -> int:
    from shardcheck.conformance import adapters
    from shardcheck.conformance.checks import FAMILIES

    args.prog = "shardcheck cells"  # its errors' one line (cli/main.py)
    families = args.family.split(",") if args.family else list(FAMILIES)
    if unknown := sorted(set(families) - set(FAMILIES)):
        raise UnknownName(f"unknown family {', '.join(unknown)}; choose from {', '.join(FAMILIES)}")
    importable_from_cwd()  # pkg.module:attr from the project's folder, as `run` finds it
    adapter = adapters.load(args.impl)  # an unknown name or a broken adapter: its error, its status
    print("\n".join(table(adapter, collect(args.impl, families, args.world_sizes))))
    return codes.OK
