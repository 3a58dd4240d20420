"""What every run must get right, each shown with a fault injected (faulty_bodies.py).

The faulty bodies run in a child pytest session (a fault must not take this session down); this
module asserts each one's outcome and message.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from child_sessions import child_session, outcome
from shardcheck.harness import run as run_body
from shardcheck.harness.threads import os_threads

SLOW_START = """
import time
import shardcheck.harness.pool
_rank_main = shardcheck.harness.pool.rank_main
def _slow_rank_main(*args, **kwargs):
    time.sleep(1.5)  # a slow pool start-up (as at large world sizes)
    _rank_main(*args, **kwargs)
shardcheck.harness.pool.rank_main = _slow_rank_main
"""

# A rank that dies as the next test is handed out, after the pool was found usable: stopped before
# it takes the task, killed 0.5 s later (the race the pool's gate covers: see RankDiedIdle)
DEATH_AT_HAND_OUT = """
import os
import signal
import threading
import shardcheck.harness.pool
_run = shardcheck.harness.pool.RankPool.run
_killed = []
def _run_after_a_death(self, task, timeout):
    if "beside_one_that_died_idle" in task.test_id and not _killed:
        _killed.append(self.procs[1].pid)
        os.kill(self.procs[1].pid, signal.SIGSTOP)
        threading.Timer(0.5, os.kill, (self.procs[1].pid, signal.SIGKILL)).start()
    return _run(self, task, timeout)
shardcheck.harness.pool.RankPool.run = _run_after_a_death
"""


@pytest.fixture(scope="module")
def pool_run(tmp_path_factory):
    return child_session(tmp_path_factory.mktemp("pool"))


@pytest.fixture(scope="module")
def thread_run(tmp_path_factory):
    return child_session(tmp_path_factory.mktemp("thread"), "--shardcheck-backend", "threaded", "-k",
                         "exception or hang_in_collective or matrix or skip or records or next or "
                         "assert_equal or world_size_zero or sleeping_rank")


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
    # the dead rank is the headline (pytest's short summary), rank 0's error its consequence
    assert rec["text"].startswith(f"rank 1 was killed by signal {sig} during the test"), rec["text"]


def test_3_the_root_cause_heads_the_failure_and_peers_are_consequences(pool_run):
    rec = outcome(pool_run, "test_rank1_exits_while_rank0_waits_in_a_collective[ws2]")
    first = rec["text"].splitlines()[0]
    assert first.startswith("rank 1 exited with code 3 during the test"), rec["text"]
    assert "as a consequence, rank 0" in first
    assert rec["text"].index("---------- rank 1 ----------") < \
        rec["text"].index("---------- rank 0 (consequence) ----------")


@pytest.mark.parametrize("which", ["pool_run", "thread_run"])
def test_4_hang_in_collective_fails_with_stacks_and_session_goes_on(which, request):
    run = request.getfixturevalue(which)
    rec = outcome(run, "test_hang_in_collective[ws2]")
    # a process rank blocked in C++ is stopped at the deadline; a thread rank alone in a threaded
    # collective, once its peer returned, is an unmatched collective at once (shardcheck/harness/threads.py)
    why = "did not finish within" if which == "pool_run" else "waits in a collective that no other rank will join"
    assert rec["outcome"] == "failed" and why in rec["text"], rec["text"]
    assert "in test_hang_in_collective" in rec["text"] and "all_reduce" in rec["text"]
    if which == "pool_run":  # what the hung rank printed comes back too
        assert "rank 0 enters the all_reduce" in rec["text"]
    assert outcome(run, "test_next_test_runs_clean[ws2]")["outcome"] == "passed"


@pytest.mark.parametrize("which", ["pool_run", "thread_run"])
def test_4_sleeping_rank_with_pytest_timeout_marker_fails_with_its_stack(which, request):
    rec = outcome(request.getfixturevalue(which), "test_hang_sleeping_rank_with_timeout_marker[ws2]")
    assert rec["outcome"] == "failed"
    label = "" if which == "pool_run" else " (thread)"
    for rank in (0, 1):  # both hang (rank 0 in the barrier, rank 1 asleep): both stacks shown
        section = rec["text"].split(f"---------- rank {rank} ----------")[1]
        assert f"rank {rank}{label} did not finish within the 4 s deadline" in section, rec["text"]
        assert "in test_hang_sleeping_rank_with_timeout_marker" in section
    assert "Timeout >4" not in rec["text"]  # ours fired first, with stacks


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead, just not yet reaped
        return f.read().split()[2] != "Z"


@pytest.mark.parametrize("limit, body", [(1, 0.4), (2, 1.3)])
def test_4_the_body_gets_the_whole_pytest_timeout_limit(pool_run, limit, body):
    rec = outcome(pool_run, f"test_timeout_{limit}_body_takes_{str(body).replace('.', '_')}_s[ws2]")
    assert rec["outcome"] == "passed", rec["text"]


def test_4_pool_start_up_does_not_count_against_the_limit(tmp_path):
    _, out, records = child_session(tmp_path, "-k", "hang_after_slow_start", conftest=SLOW_START)
    rec = records["test_hang_after_slow_start[ws2]"]
    assert "did not finish within the 1 s deadline" in rec["text"], out[-3000:]
    assert "in test_hang_after_slow_start" in rec["text"] and "Timeout >" not in rec["text"]


def test_3_a_rank_dying_while_idle_is_blamed_on_its_last_test(pool_run):
    rec = outcome(pool_run, "test_rank1_dies_just_after_returning[ws2]")
    assert rec["when"] == "teardown" and rec["outcome"] == "failed", rec
    assert "rank 1 of the gloo pool (world size 2) was killed by signal SIGTERM while idle, after test " \
           "test_bodies.py::test_rank1_dies_just_after_returning[ws2] had passed" in rec["text"]
    assert outcome(pool_run, "test_runs_on_fresh_ranks_after_an_idle_death[ws2]")["outcome"] == "passed"


def test_3_no_body_starts_beside_a_rank_that_died_while_idle(tmp_path):
    code, out, records = child_session(tmp_path, "-k", "beside_one_that_died_idle",
                                       conftest=DEATH_AT_HAND_OUT)
    rec = records["test_starts_on_no_rank_beside_one_that_died_idle[ws2]"]
    assert rec["outcome"] == "passed", rec["text"]  # once, on fresh ranks
    assert "rank 1 of the gloo pool (world size 2) was killed by signal SIGKILL while idle, before " \
           "its first test" in out, out[-3000:]


def test_3_a_run_never_ends_green_with_an_unreported_rank_death(tmp_path):
    code, out, records = child_session(tmp_path, "-k", "dies_just_after_returning or pause_between")
    assert code == 1, out[-3000:]
    assert "2 passed" in out and "1 error" in out and "killed by signal SIGTERM while idle" in out


def test_6_a_huge_output_line_is_trimmed_and_kept_whole_in_a_file(pool_run):
    rec = outcome(pool_run, "test_rank_prints_a_huge_line[ws2]")
    text = rec["text"]
    assert rec["outcome"] == "failed" and "after a huge line" in text.splitlines()[0]
    assert len(text) < 20_000 and "the end of rank 1's output" in text
    kept = text.split("bytes trimmed; whole output in ")[1].split("]")[0]
    try:
        assert os.path.getsize(kept) > 5_000_000
    finally:
        os.unlink(kept)


def test_6_stale_pool_folders_of_dead_pytest_processes_are_removed(tmp_path):
    tmp = tmp_path / "tmp"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp / f"shardcheck-pool-{dead.pid}-abc" / "sub").mkdir(parents=True)
    (tmp / f"shardcheck-pool-{os.getpid()}-def").mkdir()  # its owner (this process) is alive
    code, out, _ = child_session(tmp_path / "s", "-k", "next_test_runs_clean",
                                 env={**os.environ, "TMPDIR": str(tmp)})
    assert code == 0, out[-2000:]
    assert sorted(p.name for p in tmp.iterdir() if p.name.startswith("shardcheck-pool-")) == \
        [f"shardcheck-pool-{os.getpid()}-def"]


def test_5_sigkill_of_pytest_leaves_no_rank_alive(tmp_path):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    (tmp_path / "test_sleepy.py").write_text(
        "import os, time\nfrom shardcheck.harness import distributed\n\n"
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
    code, out, _ = child_session(tmp_path, "--shardcheck-backend", "mpi")
    assert code == 4 and "unknown backend 'mpi'" in out and "Traceback" not in out


def test_skip_raised_on_ranks_is_a_skip(pool_run, thread_run):
    for run in (pool_run, thread_run):
        rec = outcome(run, "test_skip_raised_on_ranks[ws2]")
        assert rec["outcome"] == "skipped" and "not on this rank's hardware" in rec["text"]


def test_a_skip_on_every_rank_keeps_the_pool(pool_run):
    """Every rank returned (each collective it started was matched), so the ranks are reused: a
    skipped or unsupported cell no longer costs the matrix a pool start and its caches."""
    assert outcome(pool_run, "test_skip_after_a_collective_then_next_body[ws2]")["outcome"] == "skipped"
    rec = outcome(pool_run, "test_next_body_after_the_skip[ws2]")
    assert rec["outcome"] == "passed" and rec["props"]["same_process"] == {"0": [True], "1": [True]}


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
    _, out, records = child_session(tmp_path, "--shardcheck-launch", "spawn", "-k",
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


def gemm_body(ctx):
    x = torch.randn(256, 2048)
    (x @ x.T).sum().item()  # MKL's gemm: the rank thread's OpenMP team, MKL's per-thread buffers


def test_thread_mode_returns_after_its_os_threads_ended():
    """A pool forked right after thread mode (the test above) must not inherit a lock held by a
    rank thread, or one of its OpenMP workers, that is still running its destructors (MKL's memory
    book: the forked rank then spins in its first gemm). Thread mode returns once every OS thread
    it started is gone; `Thread.join` alone returns before (this failed 5 runs in 5 without it)."""
    if not os_threads():
        pytest.skip("no /proc/self/task here: this process's OS threads cannot be listed")
    for _ in range(5):
        before = os_threads()
        verdict = run_body(gemm_body, 2, backend="threaded")
        assert verdict.outcome == "passed", verdict.message
        assert os_threads() - before == set(), "OS threads of thread mode still running as it returned"


def test_a_crashed_rank_comes_back_with_what_it_printed(pool_run):
    rec = outcome(pool_run, "test_rank_aborts_after_printing[ws2]")
    assert rec["outcome"] == "failed" and "rank 1 was killed by signal SIGABRT" in rec["text"]
    assert "rank 1 is about to abort" in rec["text"]
