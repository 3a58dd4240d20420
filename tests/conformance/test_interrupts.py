"""A report an interrupt cannot falsify: Ctrl-C once, twice or three times at any moment of a
`shardcheck run`, and the report says `complete: true` only when every collected cell finished,
the exit status is 130 for an interrupted run and never 0 for an incomplete one.

Hypothesis draws when the signals fall (after the run's first cell, and between each other: a second
Ctrl-C 0.1-0.3 s after the first once left a report saying "complete, passed" with 77 of 514 cells).
SHARDCHECK_INTERRUPT_EXAMPLES sets how many runs (default 3; the slow tier: 100)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from shardcheck.conformance.report import reading

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = int(os.environ.get("SHARDCHECK_INTERRUPT_EXAMPLES", "3"))
RUN = [sys.executable, "-m", "shardcheck.conformance.cli", "run", "--family", "sharding,loss_scaling", "--world-sizes", "2"]


def _wait_for_first_cell(stream: Path, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while not (stream.exists() and '"kind": "cell"' in stream.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before its first cell"
        time.sleep(0.01)


def _collected(stream: Path) -> int | None:
    for line in stream.read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        if entry.get("kind") == "collected":
            return entry["count"]
    return None


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(first=st.floats(0.0, 1.5), gaps=st.lists(st.floats(0.0, 0.4), min_size=0, max_size=2))
def test_no_interrupt_yields_a_complete_report_or_a_zero_exit(tmp_path, first, gaps):
    out = tmp_path / f"r{time.monotonic_ns()}.json"
    stream = out.with_suffix(".jsonl")
    proc = subprocess.Popen([*RUN, "-o", str(out)], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _wait_for_first_cell(stream, proc)
        for delay in [first, *gaps]:
            time.sleep(delay)
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # rank processes of the run, if any outlived it
        except ProcessLookupError:
            pass
    assert out.is_file(), f"no report after the interrupt (rc {proc.returncode}):\n{err[-3000:]}"
    report = reading.load(out)
    finished, collected = len(report["cells"]), _collected(stream)
    assert collected is not None, "the stream says how many cells the run collected"
    if report["complete"]:
        assert finished == collected, f"complete with {finished} of {collected} cells"
    else:
        assert proc.returncode != 0, f"an incomplete report ({finished} of {collected} cells) and exit 0"
        assert report["exit_status"] != 0
    if proc.returncode == 0:
        assert report["complete"] and finished == collected
    # 130 from shardcheck; -SIGINT (a shell's 130 too) when the signal lands in the interpreter's exit
    assert proc.returncode in (0, 1, 130, -signal.SIGINT), f"rc {proc.returncode}:\n{err[-3000:]}"
    assert "Traceback" not in err, err[-3000:]
