"""Simulate ranks of a large world in this process and build the JSON report."""
from __future__ import annotations

import datetime as dt
import resource
import sys
import time

import torch

from shardcheck.strategy import Strategy
from shardcheck.conformance.report.writer import SUITE_VERSION

FORMAT_VERSION = 2  # of the simulate report: its own format, not the conformance report's schema_version
# 2: target.mesh / strategy, classes, the every_rank_by_class cell, groups of each collective kind

from . import verdicts
from .expected import Mesh, describe_ranks, expected_row, rank_classes, representative_ranks, units_of
from .fake_group import SilentCollectives, fake_world
from .impls import simulator
from .options import STEP_MODES
from .presets import build, parameter_bytes
from .processes import each_in_own_process, parallel_jobs, progress


def _mesh(world_size: int, mesh) -> Mesh:
    return mesh if isinstance(mesh, Mesh) else Mesh.parse(mesh, world_size)


def layout_plan(model_name: str, mesh: Mesh) -> tuple[list[list[dict]], list[tuple[int, int]]]:
    """The units' expected layouts (sharded over the ``S`` ranks of a shard group) and the classes
    of shard ranks that hold alike (``expected.rank_classes``): shapes only, no process group."""
    units = units_of(build(model_name), mesh.shard)
    return units, rank_classes([p for u in units for p in u], mesh.shard)


def default_ranks(world_size: int, model_name: str, mesh=None) -> list[int]:
    """Both ends of every class of alike shard ranks, in the first and the last replica."""
    mesh = _mesh(world_size, mesh)
    return representative_ranks(layout_plan(model_name, mesh)[1], mesh)


def max_rss_mib() -> float:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 1024  # bytes on macOS, KiB on Linux


def simulate_rank(impl: str, world_size: int, model_name: str, rank: int, step: bool = True, mesh=None) -> dict:
    """One rank: the per-parameter table, totals, collectives of one step, and the verdict cells.
    ``mesh``: ``None`` (1-D, FULL_SHARD), ``"RxS"`` or an ``expected.Mesh`` (2-D, HYBRID_SHARD)."""
    sim = simulator(impl)
    mesh = _mesh(world_size, mesh)
    shard_rank = mesh.coords(rank)[1]
    with fake_world(rank, world_size, silent=False):  # silenced for the step only: sharding is millions of ops (F68)
        model = build(model_name)
        units = units_of(model, mesh.shard)
        sim.shard(model, mesh)
        measured = sim.rows(model)
        layouts = {p["name"]: p for u in units for p in u}
        for row in measured:
            row["shape"] = layouts[row["name"]]["shape"] if row["name"] in layouts else None
        expected = [expected_row(p, mesh.shard, shard_rank) for u in units for p in u]
        cells = [verdicts.sharded_dim0(measured, expected, rank),
                 verdicts.bytes_within_ceil_bound(measured, expected, rank)]
        collectives = expected_collectives = None
        if step:
            with SilentCollectives():
                collectives = sim.step(model).by_kind(describe_ranks)
            expected_collectives = sim.expected(units, mesh, rank)
            cells.append(verdicts.collectives_per_step(collectives, expected_collectives, rank))
    fields = ("name", "shape", "local_shape", "padded_rows", "bytes", "storage_bytes")
    return {
        "rank": rank,
        "params": [{k: r[k] for k in fields} for r in measured],
        "totals": {"params": len(measured), "numel": sum(p["rows"] * p["row_numel"] for p in layouts.values()),
                   "bytes": sum(r["bytes"] for r in measured),
                   "storage_bytes": sum(r["storage_bytes"] for r in measured),
                   "bound_bytes": sum(e["bound_bytes"] for e in expected)},
        "collectives": collectives, "expected_collectives": expected_collectives, "cells": cells,
        "max_rss_mib": round(max_rss_mib(), 1),
    }


def _each_rank(calls: list[tuple], model: str) -> list[dict]:
    """`simulate_rank(*call)` for each call, each rank in a process of its own, side by side (as many
    as there are CPUs and as the available memory holds at the model's parameter bytes each); the
    first rank that raised raises here."""
    results = each_in_own_process(simulate_rank, calls, parallel_jobs(len(calls), parameter_bytes(model)),
                                  progress([call[3] for call in calls]))
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


def _step_ranks(step: str, ranks: list[int], classes, mesh: Mesh) -> list[int]:
    if step == "all":
        return list(ranks)
    if step == "first":
        return ranks[:1]
    if step == "none":
        return []
    firsts = {}  # "classes": the first simulated rank of every class; and the last simulated rank
    for r in sorted(ranks):  # when it is in another replica (its groups differ)
        s = mesh.coords(r)[1]
        firsts.setdefault(next(i for i, (a, b) in enumerate(classes) if a <= s < b), r)
    last = max(ranks)
    other_replica = all(mesh.coords(r)[0] != mesh.coords(last)[0] for r in firsts.values())
    return sorted(set(firsts.values()) | ({last} if other_replica else set()))


def simulate(impl: str, world_size: int, model: str, ranks: list[int] | None = None, step: str = "classes",
             mesh=None) -> dict:
    """Simulate ``ranks`` (default: both ends of every class of alike shard ranks, first and last
    replica) and check the others by arithmetic (``every_rank_by_class``).  ``step``: where one
    training step runs -- ``"classes"`` on the first simulated rank of every class and on the last
    one if it is in another replica, ``"all"``, ``"first"``, or ``"none"`` (sharding at init
    only).  ``mesh``: ``"RxS"`` for a 2-D (replicate, shard) mesh with HYBRID_SHARD; default 1-D
    FULL_SHARD."""
    if world_size < 1:
        raise ValueError(f"world size must be positive, got {world_size}")
    if step not in STEP_MODES:
        raise ValueError(f"step must be one of {', '.join(STEP_MODES)}, got {step!r}")
    simulator(impl)  # a bad name fails before anything is built
    mesh = _mesh(world_size, mesh)
    start = time.perf_counter()
    units, classes = layout_plan(model, mesh)
    ranks = representative_ranks(classes, mesh) if ranks is None else list(ranks)
    for r in ranks:
        if not 0 <= r < world_size:
            raise ValueError(f"rank {r} is outside world size {world_size}")
    stepped = set(_step_ranks(step, ranks, classes, mesh))
    first = sorted(range(len(ranks)), key=lambda i: ranks[i] not in stepped)  # the longest (a step) first
    done = dict(zip(first, _each_rank([(impl, world_size, model, ranks[i], ranks[i] in stepped, mesh) for i in first],
                                      model)))
    per_rank = [done[i] for i in range(len(ranks))]
    cells = [c for r in per_rank for c in r["cells"]]
    covered = {i for r in ranks for i, (a, b) in enumerate(classes) if a <= mesh.coords(r)[1] < b}
    if len(covered) == len(classes):
        cells.append(verdicts.every_rank_by_class(per_rank, classes, mesh, [p for u in units for p in u]))
    return {
        "schema_version": FORMAT_VERSION,
        "suite": {"name": "shardcheck", "version": SUITE_VERSION, "mode": "simulate"},
        "started": dt.datetime.now().isoformat(timespec="seconds"),
        "target": {"implementation": impl, "world_size": world_size, "mesh": mesh.shape,
                   "strategy": str(Strategy.HYBRID_SHARD if mesh.two_d else Strategy.FULL_SHARD), "ranks": ranks, "model": model,
                   "backend": "fake", "device": "meta", "torch": torch.__version__},
        "classes": [{"shard_ranks": [a, b - 1], "ranks": (b - a) * mesh.replicate} for a, b in classes],
        "coverage": simulator(impl).coverage if step != "none" else "sharding at init only (no step)",
        "step_ranks": [r["rank"] for r in per_rank if r["collectives"] is not None],
        "ranks": per_rank,
        "cells": cells,
        "summary": {"passed": sum(c["outcome"] == "passed" for c in cells),
                    "failed": sum(c["outcome"] == "failed" for c in cells)},
        "resources": {"seconds": round(time.perf_counter() - start, 2),
                      "max_rss_mib": max([round(max_rss_mib(), 1)] + [r["max_rss_mib"] for r in per_rank])},
    }


def size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


def human_summary(report: dict) -> str:
    t, lines = report["target"], []
    mesh = "x".join(map(str, t["mesh"]))
    lines.append(f"simulate {t['implementation']} / {t['model']} at world size {t['world_size']}, {t['strategy']} "
                 f"on mesh {mesh} (ranks {', '.join(map(str, t['ranks']))}; fake group, meta tensors)")
    n = len(report["classes"])
    lines.append(f"  {n} class{'es' if n != 1 else ''} of alike shard ranks: " + ", ".join(
        f"{c['shard_ranks'][0]}..{c['shard_ranks'][1]}" for c in report["classes"][:8])
        + (", ..." if len(report["classes"]) > 8 else ""))
    lines.append(f"  coverage: {report['coverage']}")
    for r in report["ranks"]:
        tot = r["totals"]
        empty = sum(1 for p in r["params"] if p["local_shape"] and p["local_shape"][0] == 0)
        lines.append(f"  rank {r['rank']}: {tot['params']} params, holds {size(tot['storage_bytes'])} "
                     f"(bound {size(tot['bound_bytes'])}), {empty} empty shards")
        for kind, v in (r["collectives"] or {}).items():
            lines.append(f"    {kind}: {v['count']} calls, {size(v['bytes'])}, in {'; '.join(v.get('groups', []))}")
    for c in report["cells"]:
        lines.append(f"  {c['outcome'].upper():6} {c['check']} [rank {c['rank']}]: {c['detail'][0]}")
        lines += [f"         {d}" for d in c["detail"][1:]]
    s, res = report["summary"], report["resources"]
    lines.append(f"{s['passed']} passed, {s['failed']} failed in {res['seconds']} s, max RSS {res['max_rss_mib']} MiB")
    return "\n".join(lines)
