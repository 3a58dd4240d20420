"""Simulated ranks each in a forked process of their own, side by side (simulate/processes.py)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from shardcheck.conformance.simulate import processes
from shardcheck.conformance.simulate.processes import RankProcessDied, each_in_own_process, parallel_jobs


def _pid_and_square(x: int) -> tuple[int, int]:
    return os.getpid(), x * x


def _raise_for(x: int) -> int:
    if x == 2:
        raise ValueError(f"rank {x} cannot train on the fake group")
    return x


def _die_for(x: int) -> int:
    if x == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return x


def _sleep_and_time(seconds: float) -> tuple[float, float]:
    start = time.monotonic()
    time.sleep(seconds)
    return start, time.monotonic()


def test_each_call_runs_in_a_process_of_its_own_and_results_keep_their_order():
    results = each_in_own_process(_pid_and_square, [(x,) for x in range(5)], jobs=2)
    assert [square for _, square in results] == [0, 1, 4, 9, 16]
    pids = {pid for pid, _ in results}
    assert len(pids) == 5 and os.getpid() not in pids


def test_calls_run_side_by_side_up_to_jobs():
    spans = each_in_own_process(_sleep_and_time, [(0.3,)] * 2, jobs=2)
    (a0, a1), (b0, b1) = spans
    assert max(a0, b0) < min(a1, b1), f"the two calls did not overlap: {spans}"
    spans = each_in_own_process(_sleep_and_time, [(0.1,)] * 2, jobs=1)
    (a0, a1), (b0, b1) = spans
    assert b0 >= a1 or a0 >= b1, f"jobs=1 ran two calls at once: {spans}"


def test_an_exception_comes_back_in_its_place_with_the_childs_traceback():
    results = each_in_own_process(_raise_for, [(1,), (2,), (3,)], jobs=2)
    assert results[0] == 1 and results[2] == 3
    assert isinstance(results[1], ValueError) and "rank 2 cannot train" in str(results[1])
    assert any("_raise_for" in note for note in results[1].__notes__)


def test_a_process_that_dies_gives_rank_process_died_and_the_others_their_results():
    results = each_in_own_process(_die_for, [(0,), (1,), (2,)], jobs=2)
    assert results[0] == 0 and results[2] == 2
    assert isinstance(results[1], RankProcessDied) and "SIGKILL" in str(results[1])


@pytest.mark.parametrize("memory, expected", [(None, 1), (10 * 2**30, 2), (3 * 2**30, 1), (0, 1)])
def test_jobs_are_bounded_by_cpus_calls_and_available_memory(monkeypatch, memory, expected):
    monkeypatch.setattr(processes, "available_memory_bytes", lambda: memory)
    monkeypatch.setattr(processes, "usable_cpus", lambda: 4)
    assert parallel_jobs(calls=2, bytes_per_rank=2 * 2**30) == expected
    if memory:
        assert parallel_jobs(calls=8, bytes_per_rank=1) == 4  # no more than the CPUs


def test_progress_names_each_rank_as_it_ends(capsys):
    each_in_own_process(_raise_for, [(1,), (2,)], jobs=1, on_done=processes.progress([0, 4095]))
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("shardcheck simulate: rank 0 done in ") and lines[0].endswith("(1 of 2)")
    assert lines[1].startswith("shardcheck simulate: rank 4095 could not run (ValueError) in "), lines


LONG_SIMULATION = """
import os, sys, time
from shardcheck.conformance.simulate.processes import each_in_own_process

def rank(path):
    with open(path, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(60)

each_in_own_process(rank, [(sys.argv[1],)], jobs=1)
"""


def test_a_killed_command_leaves_no_simulated_rank_running(tmp_path):
    import subprocess
    import sys

    pid_file = tmp_path / "rank.pid"
    command = subprocess.Popen([sys.executable, "-c", LONG_SIMULATION, str(pid_file)])
    rank = None
    try:
        deadline = time.monotonic() + 30
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        rank = int(pid_file.read_text())
        command.terminate()  # SIGTERM: no Python cleanup runs in the command
        command.wait(10)
        deadline = time.monotonic() + 10
        while _alive(rank) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(rank), f"simulated rank {rank} outlived its command"
    finally:
        command.kill()
        if rank is not None and _alive(rank):
            os.kill(rank, signal.SIGKILL)  # this test leaves nothing behind either


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie (reaped by init later) is not running
        return f.read().split(")")[-1].split()[0] != "Z"
