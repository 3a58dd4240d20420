"""What every run must get right, each shown with a fault injected (faulty_bodies.py).

The faulty bodies run in a child pytest session (a fault must not take this session down); this
module asserts each one's outcome and message.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

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


def child_session(workdir: Path, *args: str, wait: bool = True):
    workdir.mkdir(parents=True, exist_ok=True)
    shutil.copy(HERE / "faulty_bodies.py", workdir / "test_bodies.py")
    (workdir / "conftest.py").write_text(RECORDER)
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "test_bodies.py", *args]
    proc = subprocess.Popen(cmd, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    if not wait:
        return proc
    out, _ = proc.communicate(timeout=300)
    records = {}
    if (workdir / "outcomes.jsonl").exists():
        for line in (workdir / "outcomes.jsonl").read_text().splitlines():
            rec = json.loads(line)
            records[rec["id"]] = rec
    return proc.returncode, out, records


@pytest.fixture(scope="module")
def pool_run(tmp_path_factory):
    return child_session(tmp_path_factory.mktemp("pool"))


@pytest.fixture(scope="module")
def thread_run(tmp_path_factory):
    return child_session(tmp_path_factory.mktemp("thread"), "--backend", "threaded", "-k",
                         "exception or hang_in_collective or matrix or skip or records or next or "
                         "assert_equal or world_size_zero")


def outcome(run, test_id):
    _, out, records = run
    assert test_id in records, f"{test_id} did not report; child output:\n{out[-3000:]}"
    return records[test_id]


def test_1_nonzero_exit_of_rank1_after_last_collective_fails(pool_run):
    rec = outcome(pool_run, "test_rank1_os_exit_after_last_collective[ws2]")
    assert rec["outcome"] == "failed" and "rank 1 exited with code 3" in rec["text"]
    rec = outcome(pool_run, "test_rank1_sys_exit_after_last_collective[ws2]")
    assert rec["outcome"] == "failed" and "rank 1: SystemExit: 4" in rec["text"]


@pytest.mark.parametrize("which", ["pool_run", "thread_run"])
def test_2_exception_fails_with_that_ranks_traceback_and_stops_the_others(which, request):
    rec = outcome(request.getfixturevalue(which), "test_exception_on_one_rank[ws3]")
    assert rec["outcome"] == "failed"
    text = rec["text"]
    assert text.startswith("rank 1: ValueError: injected failure on rank 1")
    assert "---------- rank 1 ----------\nTraceback" in text and 'raise ValueError("injected' in text
    # the blocked ranks were stopped, not left in the collective
    assert rec["props"]["rank_outcomes"] == {"0": "failed", "1": "failed", "2": "failed"}


@pytest.mark.parametrize("sig", ["SIGSEGV", "SIGKILL"])
def test_3_death_by_signal_names_the_signal(pool_run, sig):
    rec = outcome(pool_run, f"test_rank_dies_by_signal[ws2-{sig}]")
    assert rec["outcome"] == "failed" and f"rank 1 was killed by signal {sig}" in rec["text"]


@pytest.mark.parametrize("which", ["pool_run", "thread_run"])
def test_4_hang_in_collective_fails_with_stacks_and_session_goes_on(which, request):
    run = request.getfixturevalue(which)
    rec = outcome(run, "test_hang_in_collective[ws2]")
    assert rec["outcome"] == "failed" and "did not finish within" in rec["text"]
    assert "in test_hang_in_collective" in rec["text"] and "all_reduce" in rec["text"]
    assert outcome(run, "test_next_test_runs_clean[ws2]")["outcome"] == "passed"


def test_4_sleeping_rank_with_pytest_timeout_marker_fails_with_its_stack(pool_run):
    rec = outcome(pool_run, "test_hang_sleeping_rank_with_timeout_marker[ws2]")
    assert rec["outcome"] == "failed"
    for rank in (0, 1):  # both hang (rank 0 in the barrier, rank 1 asleep): both stacks shown
        section = rec["text"].split(f"---------- rank {rank} ----------")[1]
        assert f"rank {rank} did not finish within the 4 s deadline" in section
        assert "in test_hang_sleeping_rank_with_timeout_marker" in section
    assert "Timeout >4" not in rec["text"]  # ours fired first, with stacks


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead, just not yet reaped
        return f.read().split()[2] != "Z"


def test_5_sigkill_of_pytest_leaves_no_rank_alive(tmp_path):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    (tmp_path / "test_sleepy.py").write_text(
        "import os, time\nfrom harness import distributed\n\n"
        "@distributed(world_size=3)\ndef test_sleep(ctx):\n"
        f"    open(os.path.join({str(pid_dir)!r}, str(os.getpid())), 'w').close()\n"
        "    time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             "test_sleepy.py"], cwd=tmp_path, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while len(list(pid_dir.iterdir())) < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    pids = [int(p.name) for p in pid_dir.iterdir()]
    assert len(pids) == 3, "the ranks never started"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if _alive(p)], "rank processes outlived a SIGKILLed pytest"


def test_6_two_sessions_at_once_never_collide(tmp_path):
    args = ("-k", "next_test_runs_clean or matrix_one_bad_cell")
    procs = [child_session(tmp_path / f"s{i}", *args, wait=False) for i in range(2)]
    for proc in procs:
        out, _ = proc.communicate(timeout=300)
        assert "1 failed, 3 passed" in out, out[-2000:]


@pytest.mark.parametrize("which", ["pool_run", "thread_run"])
def test_7_a_failing_cell_does_not_poison_the_others(which, request):
    run = request.getfixturevalue(which)
    assert outcome(run, "test_matrix_one_bad_cell[ws2-1]")["outcome"] == "passed"
    bad = outcome(run, "test_matrix_one_bad_cell[ws2-2]")
    assert bad["outcome"] == "failed" and "cell 2 is broken on rank 0" in bad["text"]
    assert outcome(run, "test_matrix_one_bad_cell[ws2-3]")["outcome"] == "passed"


def test_8_bad_input_is_one_clear_line_or_a_skip(pool_run, tmp_path):
    rec = outcome(pool_run, "test_world_size_zero[ws0]")
    assert rec["when"] == "setup" and rec["text"].strip() == \
        "invalid world size 0: it must be an integer >= 1"
    rec = outcome(pool_run, "test_unknown_backend[ws2]")
    assert rec["text"].strip() == "unknown backend 'bogus'; choose one of: gloo, nccl, threaded"
    rec = outcome(pool_run, "test_nccl_without_gpus[ws2]")
    assert rec["outcome"] == "skipped" and "nccl" in rec["text"]
    code, out, _ = child_session(tmp_path, "--backend", "mpi")
    assert code == 4 and "unknown backend 'mpi'" in out and "Traceback" not in out


def test_skip_raised_on_ranks_is_a_skip(pool_run, thread_run):
    for run in (pool_run, thread_run):
        rec = outcome(run, "test_skip_raised_on_ranks[ws2]")
        assert rec["outcome"] == "skipped" and "not on this rank's hardware" in rec["text"]


def test_records_reach_the_pytest_item(pool_run, thread_run):
    for run in (pool_run, thread_run):
        rec = outcome(run, "test_records_reach_the_parent[ws2]")
        assert rec["outcome"] == "passed"
        assert rec["props"]["max_abs_err"] == {"0": [0.0], "1": [0.5]}


def test_assert_equal_across_ranks_fails_on_every_rank(pool_run):
    rec = outcome(pool_run, "test_assert_equal_across_ranks_fails_on_every_rank[ws2]")
    assert rec["outcome"] == "failed" and "rank number differs across ranks" in rec["text"]
    assert rec["props"]["rank_outcomes"] == {"0": "failed", "1": "failed"}


def test_spawn_mode_reports_like_the_pool(tmp_path):
    _, out, records = child_session(tmp_path, "--launch", "spawn", "-k",
                                    "exception_on_one_rank or next_test_runs_clean")
    assert records["test_exception_on_one_rank[ws3]"]["text"].startswith("rank 1: ValueError")
    assert records["test_next_test_runs_clean[ws2]"]["outcome"] == "passed", out[-2000:]


def test_works_under_pytest_forked(tmp_path):
    _, out, records = child_session(tmp_path, "--forked", "-k",
                                    "exception_on_one_rank or next_test_runs_clean")
    assert records["test_exception_on_one_rank[ws3]"]["text"].startswith("rank 1: ValueError"), out
    assert records["test_next_test_runs_clean[ws2]"]["outcome"] == "passed", out[-2000:]


def test_pool_forked_after_thread_mode_runs_parallel_kernels(tmp_path):
    _, out, records = child_session(tmp_path, "-k", "parallel_ops_in_a_pool")
    for backend in ("threaded", "gloo"):
        rec = records[f"test_parallel_ops_in_a_pool_forked_after_thread_mode[ws1-{backend}]"]
        assert rec["outcome"] == "passed", rec["text"][-2000:]


def test_a_crashed_rank_comes_back_with_what_it_printed(pool_run):
    rec = outcome(pool_run, "test_rank_aborts_after_printing[ws2]")
    assert rec["outcome"] == "failed" and "rank 1 was killed by signal SIGABRT" in rec["text"]
    assert "rank 1 is about to abort" in rec["text"]
