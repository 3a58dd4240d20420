"""Where the README's test command spends its CPU: `python tests/cpu_map.py`.

The test command runs on three pytest-xdist workers and keeps both cores busy, so its wall time is
its CPU time over the cores; what to cut is what costs CPU, children included (rank processes,
warm and cold child runs, which `time` misses once a fork server reaps them). This runs the same
tests in groups, one after the other in one process each (no xdist), and reads the machine's
busy CPU from /proc/stat around each: run it on a quiet machine. It prints each group's wall and
CPU seconds and its share, then one JSON line.

    python tests/cpu_map.py                 # every group
    python tests/cpu_map.py mutants checks-gloo
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BOTH = ["--shardcheck-backend", "gloo,threaded"]
GROUPS = {  # name -> pytest arguments; together, the README's test command
    "mutants": ["tests/conformance/test_mutants.py", *BOTH],
    "checks-gloo": ["shardcheck/conformance/checks", "--shardcheck-backend", "gloo"],
    "checks-threaded": ["shardcheck/conformance/checks", "--shardcheck-backend", "threaded"],
    "harness": ["tests/harness", *BOTH],
    "reference_impl": ["tests/reference_impl", *BOTH],
    "conformance-other": ["tests/conformance", "--ignore", "tests/conformance/test_mutants.py", *BOTH],
    "top-level": ["tests/test_repo.py", "tests/test_plugins_elsewhere.py", *BOTH],
}


def busy_cpu_s() -> float:
    """Seconds of CPU the whole machine has spent busy since boot (user, nice, system, irq, softirq)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq = fields[:7]
    return (user + nice + system + irq + softirq) / 100  # USER_HZ


def measure(args: list[str]) -> dict:
    cpu0, t0 = busy_cpu_s(), time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", *args], cwd=ROOT,
                          capture_output=True, text=True)
    summary = (proc.stdout.strip().splitlines() or ["(no output)"])[-1].strip("= ")
    return {"wall_s": round(time.monotonic() - t0, 1), "cpu_s": round(busy_cpu_s() - cpu0, 1),
            "exit": proc.returncode, "summary": summary}


def main(names: list[str]) -> None:
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
