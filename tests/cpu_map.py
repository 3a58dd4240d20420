"""Where the README's test command spends its CPU: `python tests/cpu_map.py`.

The test command runs on three pytest-xdist workers and keeps both cores busy, so its wall time is
its CPU time over the cores; what to cut is what costs CPU, children included (rank processes,
warm and cold child runs, which `time` misses once a fork server reaps them). This runs the same
tests in groups, one after the other in one process each (no xdist), and counts the CPU of each
group's own processes: this process is their subreaper (PR_SET_CHILD_SUBREAPER), so a child whose
parent ended without reaping it (a fork server's) is reaped here, and the user and system time of
every process of the group reach RUSAGE_CHILDREN. Other jobs on the machine are not counted (they
still slow the group down: repeat a figure measured at a load above the cores). It prints each
group's wall and CPU seconds and its share, then one JSON line.

    python tests/cpu_map.py                 # every group
    python tests/cpu_map.py mutants checks
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BOTH = ["--shardcheck-backend", "gloo,threaded"]
GROUPS = {  # name -> pytest arguments; together, the README's test command
    "mutants": ["tests/conformance/test_mutants.py", *BOTH],
    # both backends in one session with tests/conftest.py loaded (a test file under tests/ brings it), as
    # the command runs them: its threaded cells are then pairwise
    "checks": ["shardcheck/conformance/checks", "tests/conformance/test_threaded_backend.py", *BOTH],
    "harness": ["tests/harness", *BOTH],
    "reference_impl": ["tests/reference_impl", *BOTH],
    "conformance-other": ["tests/conformance", "--ignore", "tests/conformance/test_mutants.py",
                          "--ignore", "tests/conformance/test_threaded_backend.py", *BOTH],
    "top-level": ["tests/test_repo.py", "tests/test_plugins_elsewhere.py", *BOTH],
}


def become_subreaper() -> None:
    """Orphans of the groups' processes are reparented here, so that their CPU is counted (Linux)."""
    import ctypes

    PR_SET_CHILD_SUBREAPER = 36
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def reap_orphans(grace_s: float = 30.0) -> None:
    """Wait for the processes the group left behind (a fork server ends once its parent has)."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.1)


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measure(args: list[str]) -> dict:
    cpu0, t0 = children_cpu_s(), time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", *args], cwd=ROOT,
                          capture_output=True, text=True)
    wall = time.monotonic() - t0
    reap_orphans()
    summary = (proc.stdout.strip().splitlines() or ["(no output)"])[-1].strip("= ")
    return {"wall_s": round(wall, 1), "cpu_s": round(children_cpu_s() - cpu0, 1),
            "exit": proc.returncode, "summary": summary}


def main(names: list[str]) -> None:
    become_subreaper()
    results = {}
    for name in names or GROUPS:
        results[name] = measure(GROUPS[name])
        r = results[name]
        print(f"{name:>18}  wall {r['wall_s']:6.1f} s  cpu {r['cpu_s']:6.1f} s  {r['summary']}", flush=True)
    total = sum(r["cpu_s"] for r in results.values()) or 1.0
    print("cpu shares: " + ", ".join(f"{n} {100 * r['cpu_s'] / total:.0f}%" for n, r in results.items()))
    print(json.dumps({"benchmark": "test_command_cpu_map", "total_cpu_s": round(total, 1), "groups": results}))


if __name__ == "__main__":
    main(sys.argv[1:])
