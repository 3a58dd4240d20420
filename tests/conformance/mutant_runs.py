"""The mutant catalogue's child runs (tests/conformance/test_mutants.py): one pytest session per
command, in a process that starts with torch imported (tests/warm_python.py), started ahead by key on
a few threads, and what each printed (`Run`)."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import warm_python

ROOT = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 600


@dataclass
class Run:
    cmd: list[str]
    returncode: int
    output: str
    seconds: float

    def lines(self, prefix: str) -> list[str]:
        return [line for line in self.output.splitlines() if line.startswith(prefix)]

    @property
    def summary(self) -> str:
        tail = [line for line in self.output.splitlines() if line.startswith("=")]
        return tail[-1].strip("= ") if tail else "(no pytest summary)"

    def describe(self) -> str:
        return f"$ {' '.join(self.cmd)}\n(rc {self.returncode}, {self.seconds:.1f} s)\n{self.output[-6000:]}"


def run(cmd: list[str]) -> Run:
    """`cmd` (``[sys.executable, "-m", "pytest", ...]``) in a process that starts with torch imported
    (tests/warm_python.py: its own process, without 4 s of imports per run)."""
    env = {k: v for k, v in os.environ.items() if k not in ("SHARDCHECK_IMPL", "PYTEST_ADDOPTS")}
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    env["COLUMNS"] = "1000"  # the short summary keeps each failure's first message line
    start = time.monotonic()
    done = warm_python.run(cmd[1:], cwd=ROOT, env=env, timeout=RUN_TIMEOUT_S)
    return Run(cmd, done.returncode, done.stdout + done.stderr, time.monotonic() - start)


class Runs:
    """Runs by key, started ahead on a pool of `jobs` threads, each once: `get(key, cmd)` is its future."""


    def __init__(self, jobs: int) -> None:
        self.pool = ThreadPoolExecutor(max_workers=max(1, jobs), thread_name_prefix="mutant-run")
        self.futures: dict[str, Future] = {}
        self.lock = threading.Lock()

    def get(self, key: str, cmd: list[str]) -> Future:
        with self.lock:
            if key not in self.futures:
                self.futures[key] = self.pool.submit(run, cmd)
            return self.futures[key]


def jobs() -> int:
    """How many runs at a time: SHARDCHECK_MUTANT_JOBS (2), one inside an xdist worker."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return 1
    return int(os.environ.get("SHARDCHECK_MUTANT_JOBS", "2"))
