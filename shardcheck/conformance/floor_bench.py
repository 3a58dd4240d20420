"""What the matrix's collectives alone cost, against the matrix: `python -m shardcheck.conformance.floor_bench`.

Runs `shardcheck run` (the reference's default matrix on gloo unless told otherwise: the arguments
after the options are `shardcheck run`'s) with this module as a plugin, which writes down each
cell's collectives (the harness's `COLLECTIVES_PROPERTY`: every rank's calls by process group and
kind). Then it replays exactly those collectives, cell by cell, on 16-float tensors, with nothing else
(`floor_replay`): the same world sizes, process groups, kinds and counts, the same harness, backend and
number of xdist workers. That replay is the floor: what the cells would cost if their models, checks
and yardsticks were free. Prints the CPU (user + system of the whole process tree) and wall time of
both, their ratio, and one JSON line.

    python -m shardcheck.conformance.floor_bench                      # the default matrix
    python -m shardcheck.conformance.floor_bench --family clip_grad   # part of it
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

from shardcheck.conformance.cli.run import MAX_AUTO_WORKERS
from shardcheck.harness.plugin import COLLECTIVES_PROPERTY

RECORD_ENV = "SHARDCHECK_FLOOR_RECORD"
PLUGIN = "shardcheck.conformance.floor_bench"  # this module, by its import name (not "__main__")


def pytest_runtest_logreport(report) -> None:
    """In the session's main process (the xdist controller, or the only one): one line per cell
    that issued collectives."""
    path = os.environ.get(RECORD_ENV)
    issued = dict(report.user_properties).get(COLLECTIVES_PROPERTY)
    if path is None or report.when != "call" or not issued:
        return
    with open(path, "a") as f:
        f.write(json.dumps({"nodeid": report.nodeid, "world_size": len(issued),
                            "ranks": {str(rank): groups for rank, groups in issued.items()}}) + "\n")


def pytest_configure(config) -> None:
    if hasattr(config, "workerinput"):  # an xdist worker: its reports reach the controller
        config.pluginmanager.unregister(sys.modules[PLUGIN])


def _timed(cmd: list[str], env: dict, ok: tuple[int, ...] = (0, 1)) -> dict:
    """Wall time and CPU of `cmd` and every process under it (reaped, so counted in RUSAGE_CHILDREN);
    an exit status not in `ok` ends the bench."""
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    proc = subprocess.run(cmd, env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode not in ok:
        raise SystemExit(f"floor_bench: {' '.join(cmd[:6])} ... exited {proc.returncode}: {proc.stderr[-2000:]}")
    user, system = after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime
    return {"wall_s": time.perf_counter() - start, "user_s": user, "sys_s": system, "cpu_s": user + system}


def measure(run_args: list[str], workers: int) -> dict:
    """The matrix (`shardcheck run RUN_ARGS`) and the replay of its collectives, timed."""
    with tempfile.TemporaryDirectory() as tmp:
        record = os.path.join(tmp, "cells.jsonl")
        matrix = _timed([sys.executable, "-m", "shardcheck.conformance.cli", "run", "--workers", str(workers),
                         "--output", os.path.join(tmp, "report.json"), *run_args, "--", "-p", PLUGIN],
                        {RECORD_ENV: record})
        cells = [json.loads(line) for line in open(record)] if os.path.exists(record) else []
        if not cells:
            raise SystemExit("floor_bench: the run recorded no cell with collectives")
        spec = os.path.join(tmp, "spec.json")
        with open(spec, "w") as f:
            json.dump(cells, f)
        from shardcheck.conformance import floor_replay

        workers_args = ["-n", str(workers)] if workers else ["-p", "no:xdist"]
        floor = _timed([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *workers_args,
                        "--shardcheck-backend", _backend(run_args), floor_replay.__file__],
                       {floor_replay.SPEC_ENV: spec}, ok=(0,))  # a replayed cell that failed: no floor
    calls = sum(n for c in cells for groups in c["ranks"].values() for kinds in groups.values() for n in kinds.values())
    return {"benchmark": "matrix_floor", "workers": workers, "cells": len(cells), "rank_collectives": calls,
            "matrix": matrix, "floor": floor, "cpu_ratio": matrix["cpu_s"] / max(floor["cpu_s"], 1e-9)}


def _backend(run_args: list[str]) -> str:
    for i, arg in enumerate(run_args):
        if arg == "--backend" and i + 1 < len(run_args):
            return run_args[i + 1]
        if arg.startswith("--backend="):
            return arg.split("=", 1)[1]
    return "gloo"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=min(os.cpu_count() or 1, MAX_AUTO_WORKERS),
                        help="xdist workers for both runs (default: one per core, at most 4, as `shardcheck run`)")
    args, run_args = parser.parse_known_args(argv)
    result = measure(run_args, args.workers)
    print(f"{'':8} {'wall s':>8} {'user s':>8} {'sys s':>8} {'CPU s':>8}")
    for name in ("matrix", "floor"):
        r = result[name]
        print(f"{name:8} {r['wall_s']:8.1f} {r['user_s']:8.1f} {r['sys_s']:8.1f} {r['cpu_s']:8.1f}")
    print(f"{result['cells']} cells with collectives, {result['rank_collectives']} collectives issued (summed over "
          f"ranks); CPU matrix/floor = {result['cpu_ratio']:.2f}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
