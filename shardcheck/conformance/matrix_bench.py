"""Where the conformance matrix spends its time: `python -m shardcheck.conformance.matrix_bench`.

Runs `shardcheck run` (the reference implementation, every family, every world size a check declares,
unless told otherwise) on gloo, then the same matrix on the threaded backend, each in a child process, and prints
a table and one JSON line per backend plus the gloo/threaded ratio: wall time, user and system CPU (the
run and its ranks), cells, and the split of the wall time into

    harness    pytest, the harness's dispatch, barriers and result collection, start-up
    build      model construction and sharding (`impl.shard`, `impl.trainer`, constructors, copies)
    train      training steps (forward, backward, optimizer and scaler steps, clipping)
    compare    full-state gathers and comparisons (`full_grads`, `full_params`, `assert_close`)
    other      the rest of the check bodies
    reporting  the report writer and the progress display

and each family's share of the cells' own time (their pytest durations, summed).

The split (gloo runs; the threaded run is timed only) comes from a sampling profiler (about 100 Hz)
in the pytest process and in every rank: it is loaded into the run as a pytest plugin
(`-p shardcheck.conformance.matrix_bench`, active only when SHARDCHECK_BENCH_DIR is set). A rank's sample is put in the first category named by a frame of its check body, outermost
first (a gather inside a forward counts as training; a forward inside `full_params` as comparison).
The parent's time waiting for ranks is split in the ranks' proportions.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from shardcheck.conformance.report import reading
from shardcheck.harness.stacks import BODY_CALLER

INTERVAL_S = 0.01
SAMPLER = pytest.StashKey()
CATEGORIES = ("harness", "build", "train", "compare", "other", "reporting")
BY_FUNCTION = {
    **dict.fromkeys(("full_grads", "full_params", "full_state", "assert_close",
                     "assert_equal_across_ranks", "all_gather_object"), "compare"),
    **dict.fromkeys(("shard", "trainer", "__init__", "deepcopy", "build", "to"), "build"),
    **dict.fromkeys(("forward_backward", "step", "backward", "_wrapped_call_impl",
                     "clip_grad_norm_", "unscale_", "update", "zero_grad"), "train"),
}
RANKS_RUNNING = ("wait_for_ranks", "run_threads")  # the parent's frames while a test's ranks run


def _frames(frame) -> list:
    """Outermost first."""
    out = []
    while frame is not None:
        out.append(frame)
        frame = frame.f_back
    return out[::-1]


def rank_category(frame) -> str | None:
    """The category of a rank thread's sample; None while it is idle between tests."""
    frames = _frames(frame)
    starts = [i for i, f in enumerate(frames)
              if f.f_code.co_name == "execute" and f.f_code.co_filename.endswith(BODY_CALLER)]
    if not starts:
        idle = any(f.f_code.co_name in ("recv", "_recv", "get", "wait") for f in frames[-3:])
        return None if idle else "harness"
    body = [f for f in frames[starts[0] + 1:] if "/harness/" not in f.f_code.co_filename]
    for f in body[1:]:  # body[0] is the check itself
        category = BY_FUNCTION.get(f.f_code.co_name)
        if category:
            return category
    return "other" if body else "harness"


def parent_category(frame) -> str:
    """`ranks` while the parent waits for a test's ranks; else reporting or harness (pytest included)."""
    frames = _frames(frame)
    if any("/conformance/report/" in f.f_code.co_filename or "/conformance/cli/progress" in f.f_code.co_filename
           for f in frames):
        return "reporting"
    if any(f.f_code.co_name in RANKS_RUNNING and "/harness/" in f.f_code.co_filename for f in frames):
        return "ranks"
    return "harness"


class Sampler(threading.Thread):
    """Seconds per category of the threads it is told to watch, sampled; dumped every second."""

    def __init__(self, path: str, watch) -> None:
        super().__init__(name="shardcheck-bench-sampler", daemon=True)
        self.path, self.watch, self.counts = path, watch, collections.Counter()

    def run(self) -> None:
        last_dump = last = time.monotonic()
        while True:
            time.sleep(INTERVAL_S)
            now = time.monotonic()
            frames = sys._current_frames()
            for kind, ident in self.watch():
                frame = frames.get(ident)
                if frame is not None:
                    category = parent_category(frame) if kind == "parent" else rank_category(frame)
                    if category:  # weighted by the time since the last sample (the GIL may delay us)
                        self.counts[f"{kind}:{category}"] += now - last
            # let go of the frames before sleeping: a held frame keeps its locals (a rank's tensors)
            # alive, which the family sharding would measure as memory the engine holds
            frames = frame = None
            last = now
            if time.monotonic() - last_dump > 1.0:
                self.dump()
                last_dump = time.monotonic()

    def dump(self) -> None:
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump(dict(self.counts), f)
        os.replace(tmp, self.path)


def _start(role: str, watch) -> Sampler:
    sampler = Sampler(os.path.join(os.environ["SHARDCHECK_BENCH_DIR"], f"{role}-{os.getpid()}.json"), watch)
    sampler.start()
    return sampler


def pytest_configure(config) -> None:
    """As a pytest plugin (`-p shardcheck.conformance.matrix_bench`): sample this process and every rank forked from it."""
    if not os.environ.get("SHARDCHECK_BENCH_DIR"):
        return
    main = threading.main_thread().ident

    def parent_and_rank_threads():
        yield "parent", main
        for t in threading.enumerate():
            if t.name.startswith("shardcheck-rank"):
                yield "rank", t.ident

    config.stash[SAMPLER] = _start("parent", parent_and_rank_threads)
    os.register_at_fork(after_in_child=lambda: _start("rank", lambda: [("rank", threading.main_thread().ident)]))


def pytest_unconfigure(config) -> None:
    sampler = config.stash.get(SAMPLER, None)
    if sampler is not None:
        sampler.dump()


def split(bench_dir: str, wall: float) -> dict[str, float]:
    """Seconds of `wall` per category (see the module docstring)."""
    parent, ranks = collections.Counter(), collections.Counter()
    for name in os.listdir(bench_dir):
        if name.startswith(("parent-", "rank-")) and name.endswith(".json"):
            with open(os.path.join(bench_dir, name)) as f:
                for key, n in json.load(f).items():
                    kind, category = key.split(":")
                    (parent if kind == "parent" else ranks)[category] += n
    sampled = sum(parent.values())
    out = dict.fromkeys(CATEGORIES, 0.0)
    out["harness"] = max(0.0, wall - sampled)  # interpreter start-up and imports, before sampling
    total_parent, total_ranks = sum(parent.values()) or 1, sum(ranks.values()) or 1
    for category, n in parent.items():
        share = wall * min(1.0, sampled / wall) * n / total_parent
        if category == "ranks":
            for rank_category_, m in ranks.items():
                out[rank_category_] += share * m / total_ranks
        else:
            out[category] += share
    return {k: round(v, 2) for k, v in out.items()}


def run_matrix(backend: str, args) -> dict:
    with tempfile.TemporaryDirectory(prefix="shardcheck-bench-") as tmp:
        report = os.path.join(tmp, "report.json")
        cmd = [sys.executable, "-m", "shardcheck.conformance.cli", "run", "--backend", backend, "--output", report]
        if args.world_sizes:
            cmd += ["--world-sizes", args.world_sizes]
        for impl in args.impl:
            cmd += ["--impl", impl]
        if args.family:
            cmd += ["--family", args.family]
        # The sampler walks the stacks of other threads; in thread mode the ranks are threads that come
        # and go under it, which crashed the run once (SIGSEGV): the threaded run is timed, not split.
        sampled = backend != "threaded"
        if sampled:
            cmd += ["--", "-p", "shardcheck.conformance.matrix_bench"]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        proc = subprocess.run(cmd, env={**os.environ, "SHARDCHECK_BENCH_DIR": tmp},
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if not os.path.exists(report):
            raise SystemExit(f"shardcheck.conformance.matrix_bench: the {backend} run wrote no report (exit {proc.returncode}): "
                             f"{proc.stderr.strip().splitlines()[-1:]}")
        cells = reading.load(report)["cells"]
        by_family = collections.Counter()
        for c in cells:
            by_family[c["family"]] += c["duration_s"]
        return {"by_family_s": {f: round(t, 2) for f, t in by_family.most_common()},"backend": backend, "exit_status": proc.returncode, "wall_s": round(wall, 2),
                "user_s": round(after.ru_utime - before.ru_utime, 2),
                "sys_s": round(after.ru_stime - before.ru_stime, 2), "cells": len(cells),
                "passed": sum(c["outcome"] == "passed" for c in cells),
                "split_s": split(tmp, wall) if sampled else None}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m shardcheck.conformance.matrix_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--impl", action="append", default=None, help="default: reference")
    parser.add_argument("--world-sizes", default=None, help="default: every size a check declares (2, 3, 4)")
    parser.add_argument("--family", default=None, help="comma-separated families (default: all)")
    parser.add_argument("--backends", default="gloo,threaded")
    args = parser.parse_args(argv)
    args.impl = args.impl or ["reference"]
    rows = [run_matrix(backend, args) for backend in args.backends.split(",")]
    print(f"{'backend':>9} {'wall s':>7} {'user s':>7} {'sys s':>7} {'cells':>6}  " +
          " ".join(f"{c:>9}" for c in CATEGORIES))
    for r in rows:
        print(f"{r['backend']:>9} {r['wall_s']:>7.1f} {r['user_s']:>7.1f} {r['sys_s']:>7.1f} {r['cells']:>6}  " +
              " ".join(f"{r['split_s'][c]:>9.1f}" if r["split_s"] else f"{'-':>9}" for c in CATEGORIES))
    for r in rows:  # each family's share of the cells' own time (pytest's durations, summed)
        total = sum(r["by_family_s"].values()) or 1.0
        print(f"{r['backend']:>9} by family: " + ", ".join(
            f"{f} {t:.1f} s ({t / total:.0%})" for f, t in r["by_family_s"].items()))
    summary = {"benchmark": "conformance_matrix", "impl": args.impl, "world_sizes": args.world_sizes,
               "runs": rows}
    if len(rows) == 2:
        summary[f"{rows[0]['backend']}_over_{rows[1]['backend']}"] = round(rows[0]["wall_s"] / rows[1]["wall_s"], 2)
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
