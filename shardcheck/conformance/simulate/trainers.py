"""`shardcheck simulate` for any registered implementation: its own trainer (the behaviour protocol,
`Adapter.trainer`) on torch's fake process group, measured by the family sharding's instruments
(shardcheck/conformance/measure: bytes held by kind, gathered after forward, collectives) and judged by the same
promises (shardcheck/conformance/measure/promises.py). Nothing here knows any engine.

One process plays one rank of N (fake_group.fake_world): the model is built on the meta device
when the adapter declares `meta_init` (its trainer materializes this rank's shards alone), else on
the CPU, whole, as the engine needs it (the report says which, and the bytes); it is handed to the trainer with every transformer block as a unit (FULL_SHARD, or
HYBRID_SHARD on a 2-D (replicate, shard) mesh), and trained one step; the collectives return at once with meaningless data, so nothing is compared but bytes. The
unsharded figures are the model's arithmetic, not a run (unsharded training of a billion parameters
does not fit a rank): parameters P, Adam's two moments 2P, gradients P, and no activation worth
counting at the presets' few tokens.
"""

from __future__ import annotations

import contextlib
import os
import time

import torch

from shardcheck.strategy import Strategy
from shardcheck.conformance import adapters
from shardcheck.conformance.measure import footprint, promises
from shardcheck.conformance.protocol import Optimizer, Recipe, ShardSpec
from shardcheck.conformance.protocol.capabilities import of_strategy

from .expected import Mesh
from .fake_group import fake_world
from .presets import build, parameter_bytes
from .processes import each_in_own_process, parallel_jobs, progress
from .shard_layouts import max_rss_mib, size


class _Rank:
    """What `footprint.measure` asks of a rank: its device and seeded construction."""

    def __init__(self, rank: int) -> None:
        self.rank, self.device = rank, torch.device("cpu")

    @contextlib.contextmanager
    def seeded(self, seed: int):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            yield


@contextlib.contextmanager
def _local_rank(rank: int):
    """LOCAL_RANK set as a launcher sets it (engines read it): this process is that one rank."""
    before = os.environ.get("LOCAL_RANK")
    os.environ["LOCAL_RANK"] = str(rank)
    try:
        yield
    finally:
        if before is None:
            del os.environ["LOCAL_RANK"]
        else:
            os.environ["LOCAL_RANK"] = before


def _loss(model, tokens):
    return model(tokens).float().mean()


RECIPE = Recipe(loss_fn=_loss, optimizer=Optimizer("adam", lr=1e-3))


def _capable(impl: str, strategy: str):
    adapter = adapters.load(impl)
    if of_strategy(strategy) not in adapter.capabilities:
        raise ValueError(f"{impl} does not declare {of_strategy(strategy)}: nothing to simulate through its trainer")
    return adapter


def unsharded_figures(parameter_bytes: int) -> dict:
    """Unsharded data-parallel training of `parameter_bytes` float32 parameters with Adam, by
    arithmetic (the module doc)."""
    p = parameter_bytes
    return {"rest": {"total": 3 * p, "optimizer": 2 * p, "parameters": p, "gradients": 0, "other": 0},
            "gradients": p, "backward": p, "forward": 0, "peak": 2 * p, "traffic": {}}


def simulate_rank(impl: str, world_size: int, model_name: str, rank: int, mesh: str | None = None) -> dict:
    """One rank of `world_size`: FULL_SHARD (or HYBRID_SHARD on the 2-D `mesh` "RxS") by `impl`'s
    trainer, its figures and broken promises."""
    from torch.distributed.device_mesh import init_device_mesh

    shape2d = Mesh.parse(mesh, world_size)
    strategy = Strategy.HYBRID_SHARD if shape2d.two_d else Strategy.FULL_SHARD
    adapter = _capable(impl, strategy)
    started = time.perf_counter()
    with fake_world(rank, world_size), _local_rank(rank):
        shape = build(model_name)  # on meta: its units and input, for free
        p = parameter_bytes(model_name)
        units = tuple(f"blocks.{i}" for i in range(len(shape.blocks)))
        device_mesh = (init_device_mesh("cpu", (shape2d.replicate, shape2d.shard), mesh_dim_names=("replicate", "shard"))
                       if shape2d.two_d else init_device_mesh("cpu", (world_size,)))
        spec = ShardSpec(strategy=strategy, units=units, mesh=device_mesh)
        tokens = shape.example_input("cpu")
        device = "meta" if "meta_init" in adapter.capabilities else "cpu"
        measured = footprint.measure(_Rank(rank), lambda: build(model_name, device),
                                     lambda model, recipe: adapter.trainer(model, spec, recipe), RECIPE, [tokens])
    shapes = promises.Shapes.of(shape, units, shape2d.shard)
    failures, figures = promises.judge(strategy, shape2d.shard, shape2d.replicate, measured, unsharded_figures(p), shapes)
    if device == "meta":
        failures += promises.materialized_whole(measured["construction"], shapes)
    return {"rank": rank, "failures": failures, "figures": figures, "built_on": device,
            "construction_bytes": measured["construction"],
            "seconds": round(time.perf_counter() - started, 1), "max_rss_mib": round(max_rss_mib(), 1)}


def simulate(impl: str, world_size: int, model_name: str, ranks: list[int] | None = None,
             mesh: str | None = None) -> dict:
    """Simulate `ranks` (default the first and the last) of `impl`'s FULL_SHARD trainer (HYBRID_SHARD
    on the 2-D `mesh` "RxS"): a report shaped like shard_layouts.simulate's (target, ranks, cells, summary,
    resources)."""
    if world_size < 1:
        raise ValueError(f"world size must be positive, got {world_size}")
    shape2d = Mesh.parse(mesh, world_size)  # a bad mesh, name or a replicating engine fails first
    strategy = Strategy.HYBRID_SHARD if shape2d.two_d else Strategy.FULL_SHARD
    _capable(impl, strategy)
    ranks = sorted(set(ranks or {0, world_size - 1}))
    for r in ranks:
        if not 0 <= r < world_size:
            raise ValueError(f"rank {r} is outside world size {world_size}")
    started = time.perf_counter()
    per_rank, cells = [], []
    for r, result in zip(ranks, _each_rank(impl, world_size, model_name, ranks, mesh)):
        if isinstance(result, BaseException):
            if not isinstance(result, Exception):
                raise result  # KeyboardInterrupt, SystemExit: the command stops
            # the engine could not train this rank on the fake group: say so
            cells.append({"check": "footprint", "rank": r, "outcome": "error",
                          "detail": [f"{type(result).__name__}: {(str(result).strip().splitlines() or [''])[0]}"]})
            continue
        per_rank.append(result)
        cells.append({"check": "footprint", "rank": r, "outcome": "failed" if result["failures"] else "passed",
                      "detail": result["failures"] or [_held(result["figures"])]})
    return {
        "suite": {"name": "shardcheck", "mode": "simulate"},
        "target": {"implementation": impl, "world_size": world_size, "strategy": strategy, "ranks": ranks,
                   "mesh": [shape2d.replicate, shape2d.shard],
                   "model": model_name, "backend": "fake", "device": "cpu", "torch": torch.__version__},
        "coverage": "the implementation's own trainer, one step on the CPU against a fake process group; "
                    "memory by kind and traffic measured (shardcheck/conformance/measure), no numerics",
        "ranks": per_rank, "cells": cells,
        "summary": {"passed": sum(c["outcome"] == "passed" for c in cells),
                    "failed": sum(c["outcome"] != "passed" for c in cells)},
        "resources": {"seconds": round(time.perf_counter() - started, 2), "max_rss_mib": round(max_rss_mib(), 1)},
    }


def _each_rank(impl: str, world_size: int, model_name: str, ranks: list[int], mesh) -> list:
    """`simulate_rank` of each rank in a process of its own (engines keep process-global state that
    one rank's world must not leave to the next), side by side: as many as there are CPUs and as the
    available memory holds at the model's bytes per rank (twice that for an engine built whole)."""
    whole = "meta_init" not in adapters.load(impl).capabilities
    jobs = parallel_jobs(len(ranks), parameter_bytes(model_name) * (2 if whole else 1))
    return each_in_own_process(simulate_rank, [(impl, world_size, model_name, r, mesh) for r in ranks], jobs,
                               progress(ranks))


def _held(figures: dict) -> str:
    rows, p = figures["rows"], figures["parameter_bytes"]

    def share(name: str) -> str:
        measured, bound = rows[name][:2]
        return f"{measured / p:.4f}x (bound {bound / p:.4f}x)"

    return (f"holds {share('held between steps')} of the parameters' bytes between steps, gathers at most "
            f"{share('gathered during backward')}, keeps {share('kept gathered after forward')} after forward, "
            f"sends {figures['sent']['ratio']:.2f}x of {figures['strategy']}'s formula")


def human_summary(report: dict) -> str:
    t = report["target"]
    lines = [f"simulate {t['implementation']} / {t['model']} at world size {t['world_size']}, {t['strategy']} "
             f"through its trainer (ranks {', '.join(map(str, t['ranks']))}; fake group, CPU tensors)",
             f"  coverage: {report['coverage']}"]
    for r in report["ranks"]:
        by_kind = r["figures"]["rest"]["by_kind"]
        p = r["figures"]["parameter_bytes"]
        built = (f"on meta, at most {size(r['construction_bytes'])} ({r['construction_bytes'] / p:.4f}x of the "
                 f"parameters) alive while the trainer was made" if r["built_on"] == "meta" else
                 f"whole on the CPU ({size(r['construction_bytes'])}): the adapter declares no meta_init")
        lines.append(f"  rank {r['rank']} ({r['seconds']} s, {r['max_rss_mib']:.0f} MiB RSS, built {built}): holds " + ", ".join(
            f"{k} {size(v)}" for k, v in by_kind.items()) + "; sends " + ", ".join(
            f"{k} {size(v['sent'])}" for k, v in sorted(r["figures"]["sent"]["by_kind"].items())))
    for c in report["cells"]:
        lines.append(f"  {c['outcome'].upper():6} {c['check']} [rank {c['rank']}]: {c['detail'][0]}")
        lines += [f"         {d}" for d in c["detail"][1:]]
    s, res = report["summary"], report["resources"]
    errors = sum(c["outcome"] == "error" for c in report["cells"])
    lines.append(f"{s['passed']} passed, {s['failed'] - errors} failed, {errors} could not run in {res['seconds']} s"
                 f" (largest rank's RSS {max([r['max_rss_mib'] for r in report['ranks']] or [0])} MiB)")
    return "\n".join(lines)
