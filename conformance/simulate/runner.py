"""Simulate ranks of a large world in this process and build the JSON report."""
from __future__ import annotations

import datetime as dt
import resource
import sys
import time

import torch

from conformance.report.writer import SUITE_VERSION

FORMAT_VERSION = 1  # of the simulate report: its own format, not the conformance report's schema_version

from . import verdicts
from .expected import expected_row, units_of
from .fake_group import fake_world
from .impls import simulator
from .presets import build


def default_ranks(world_size: int) -> list[int]:
    """Rank 0, a middle rank and the last rank (where trailing shards are short or empty)."""
    return sorted({0, world_size // 2, world_size - 1})


def max_rss_mib() -> float:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 1024  # bytes on macOS, KiB on Linux


def simulate_rank(impl: str, world_size: int, model_name: str, rank: int, step: bool = True) -> dict:
    """One rank: the per-parameter table, totals, collectives of one step, and the verdict cells."""
    sim = simulator(impl)
    with fake_world(rank, world_size):
        model = build(model_name)
        units = units_of(model, world_size)
        sim.shard(model)
        measured = sim.rows(model)
        layouts = {p["name"]: p for u in units for p in u}
        for row in measured:
            row["shape"] = layouts[row["name"]]["shape"] if row["name"] in layouts else None
        expected = [expected_row(p, world_size, rank) for u in units for p in u]
        cells = [verdicts.sharded_dim0(measured, expected, rank),
                 verdicts.bytes_within_ceil_bound(measured, expected, rank)]
        collectives = expected_collectives = None
        if step:
            collectives = sim.step(model).by_kind()
            expected_collectives = sim.expected(units, world_size)
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
    }


STEP_MODES = ("all", "first", "none")  # on which simulated ranks one training step runs


def simulate(impl: str, world_size: int, model: str, ranks: list[int] | None = None, step: str = "all") -> dict:
    """``step="first"`` counts the collectives on the first rank only (their counts and sizes do
    not depend on the rank: buffers are padded); ``"none"`` checks the sharding at init only."""
    if world_size < 1:
        raise ValueError(f"world size must be positive, got {world_size}")
    if step not in STEP_MODES:
        raise ValueError(f"step must be one of {', '.join(STEP_MODES)}, got {step!r}")
    ranks = default_ranks(world_size) if ranks is None else ranks
    start = time.perf_counter()
    per_rank = [simulate_rank(impl, world_size, model, r, step == "all" or (step == "first" and i == 0))
                for i, r in enumerate(ranks)]
    cells = [c for r in per_rank for c in r["cells"]]
    return {
        "schema_version": FORMAT_VERSION,
        "suite": {"name": "shardcheck", "version": SUITE_VERSION, "mode": "simulate"},
        "started": dt.datetime.now().isoformat(timespec="seconds"),
        "target": {"implementation": impl, "world_size": world_size, "ranks": ranks, "model": model,
                   "backend": "fake", "device": "meta", "torch": torch.__version__},
        "coverage": simulator(impl).coverage if step != "none" else "sharding at init only (no step)",
        "step_ranks": [r["rank"] for r in per_rank if r["collectives"] is not None],
        "ranks": per_rank,
        "cells": cells,
        "summary": {"passed": sum(c["outcome"] == "passed" for c in cells),
                    "failed": sum(c["outcome"] == "failed" for c in cells)},
        "resources": {"seconds": round(time.perf_counter() - start, 2), "max_rss_mib": round(max_rss_mib(), 1)},
    }


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


def human_summary(report: dict) -> str:
    t, lines = report["target"], []
    lines.append(f"simulate {t['implementation']} / {t['model']} at world size {t['world_size']} "
                 f"(ranks {', '.join(map(str, t['ranks']))}; fake group, meta tensors)")
    lines.append(f"  coverage: {report['coverage']}")
    for r in report["ranks"]:
        tot = r["totals"]
        empty = sum(1 for p in r["params"] if p["local_shape"] and p["local_shape"][0] == 0)
        lines.append(f"  rank {r['rank']}: {tot['params']} params, holds {_size(tot['storage_bytes'])} "
                     f"(bound {_size(tot['bound_bytes'])}), {empty} empty shards")
        for kind, v in (r["collectives"] or {}).items():
            lines.append(f"    {kind}: {v['count']} calls, {_size(v['bytes'])}")
    for c in report["cells"]:
        lines.append(f"  {c['outcome'].upper():6} {c['check']} [rank {c['rank']}]: {c['detail'][0]}")
        lines += [f"         {d}" for d in c["detail"][1:]]
    s, res = report["summary"], report["resources"]
    lines.append(f"{s['passed']} passed, {s['failed']} failed in {res['seconds']} s, max RSS {res['max_rss_mib']} MiB")
    return "\n".join(lines)
