"""A child pytest session that runs test bodies with injected faults or leaks (a fault must not take
the calling session down), and the outcome it recorded for each test."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import warm_python

HERE = Path(__file__).parent
RECORDER = """
import json
def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":
        with open("outcomes.jsonl", "a") as f:
            f.write(json.dumps({"id": report.nodeid.split("::")[-1], "when": report.when,
                                "outcome": report.outcome, "text": report.longreprtext,
                                "props": dict(report.user_properties)}) + "\\n")
"""


def child_session(workdir: Path, *args: str, wait: bool = True, conftest: str = "", env=None,
                  bodies: str = "faulty_bodies.py"):
    """Run the test bodies of `bodies` (a file beside this one) in a child pytest session in `workdir`:
    (exit code, output, {test id: its recorded outcome}), or the Popen when not `wait`."""
    workdir.mkdir(parents=True, exist_ok=True)
    shutil.copy(HERE / bodies, workdir / "test_bodies.py")
    (workdir / "conftest.py").write_text(RECORDER + conftest)
    argv = ["-m", "pytest", "-p", "no:cacheprovider", "-q", "test_bodies.py", *args]
    if not wait:
        return subprocess.Popen([sys.executable, *argv], cwd=workdir, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True, env=env)
    done = warm_python.run(argv, cwd=workdir, env=env, timeout=300)  # its own process, torch imported
    out = done.stdout + done.stderr
    records = {}
    if (workdir / "outcomes.jsonl").exists():
        for line in (workdir / "outcomes.jsonl").read_text().splitlines():
            rec = json.loads(line)
            records[rec["id"]] = rec
    return done.returncode, out, records


def outcome(run, test_id):
    _, out, records = run
    assert test_id in records, f"{test_id} did not report; child output:\n{out[-3000:]}"
    return records[test_id]
