"""Test bodies with injected faults, run by test_faults.py in a child pytest session.

Each name says the fault; test_faults.py asserts the outcome and message that each must produce.
"""

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from shardcheck.harness import distributed


@distributed(world_size=2)
def test_rank1_os_exit_after_last_collective(ctx):
    dist.barrier()
    if ctx.rank == 1:
        os._exit(3)


@distributed(world_size=2)
def test_rank1_sys_exit_after_last_collective(ctx):
    dist.barrier()
    if ctx.rank == 1:
        raise SystemExit(4)


@distributed(world_size=3)
def test_exception_on_one_rank(ctx):
    if ctx.rank == 1:
        raise ValueError("injected failure on rank 1")
    dist.barrier()  # the others block here until the harness stops them


@distributed(world_size=2)
@pytest.mark.parametrize("sig", ["SIGSEGV", "SIGKILL"])
def test_rank_dies_by_signal(ctx, sig):
    dist.barrier()
    if ctx.rank == 1:
        os.kill(os.getpid(), getattr(signal, sig))
    dist.barrier()


@distributed(world_size=2, timeout=3)
def test_hang_in_collective(ctx):
    if ctx.rank == 0:
        print("rank 0 enters the all_reduce", flush=True)
        dist.all_reduce(torch.ones(1))  # rank 1 never joins


@distributed(world_size=2)
@pytest.mark.timeout(4)
def test_hang_sleeping_rank_with_timeout_marker(ctx):
    if ctx.rank == 1:
        time.sleep(600)
    dist.barrier()


@distributed(world_size=2)
def test_next_test_runs_clean(ctx):
    t = torch.full((1,), float(ctx.rank))
    dist.all_reduce(t)
    assert t.item() == 1.0


@distributed(world_size=2)
@pytest.mark.parametrize("cell", [1, 2, 3])
def test_matrix_one_bad_cell(ctx, cell):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert cell != 2 or ctx.rank != 0, "cell 2 is broken on rank 0"


@distributed(world_size=0)
def test_world_size_zero(ctx):
    pass


@distributed(world_size=2, backend="bogus")
def test_unknown_backend(ctx):
    pass


@distributed(world_size=2, backend="nccl")
def test_nccl_without_gpus(ctx):
    pass


@distributed(world_size=2)
def test_skip_raised_on_ranks(ctx):
    pytest.skip("not on this rank's hardware")


@distributed(world_size=2)
def test_skip_after_a_collective_then_next_body(ctx):
    dist.barrier()
    with open(f"rank{ctx.rank}.pid", "w") as f:  # the child session's folder
        f.write(str(os.getpid()))
    pytest.skip("skipped after a collective, on every rank")


@distributed(world_size=2)
def test_next_body_after_the_skip(ctx):
    with open(f"rank{ctx.rank}.pid") as f:
        ctx.record("same_process", f.read() == str(os.getpid()))
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2.0


@distributed(world_size=2)
def test_records_reach_the_parent(ctx):
    ctx.record("max_abs_err", 0.5 * ctx.rank)
    ctx.assert_equal_across_ranks(torch.ones(2), "ones")
    assert ctx.all_gather_object(ctx.rank) == [0, 1]


@distributed(world_size=2)
def test_assert_equal_across_ranks_fails_on_every_rank(ctx):
    ctx.assert_equal_across_ranks(ctx.rank, "rank number")


@distributed(world_size=1, backend=["threaded", "gloo"], timeout=60)
def test_parallel_ops_in_a_pool_forked_after_thread_mode(ctx):
    # thread mode runs intra-op parallel (OpenMP) kernels in the pytest process; a pool forked
    # afterwards must still run them (libgomp is not fork-safe), and must not inherit a lock an ending
    # rank thread held (MKL's memory book: a fork in that moment spins in the gemm; see
    # test_thread_mode_returns_after_its_os_threads_ended)
    x = torch.randn(512, 4096)
    torch.nn.functional.layer_norm(x, (4096,)).sum().item()
    (x @ x.T).sum().item()


@distributed(world_size=2)
def test_rank_aborts_after_printing(ctx):
    dist.barrier()
    if ctx.rank == 1:
        print("rank 1 is about to abort", flush=True)
        os.abort()
    dist.barrier()


@distributed(world_size=2)
def test_rank1_exits_while_rank0_waits_in_a_collective(ctx):
    if ctx.rank == 1:
        os._exit(3)
    dist.all_reduce(torch.ones(1))  # rank 0 gets "Connection closed by peer": a consequence


@distributed(world_size=2)
@pytest.mark.timeout(1)
def test_timeout_1_body_takes_0_4_s(ctx):
    time.sleep(0.4)
    dist.barrier()


@distributed(world_size=2)
@pytest.mark.timeout(2)
def test_timeout_2_body_takes_1_3_s(ctx):
    time.sleep(1.3)
    dist.barrier()


@distributed(world_size=2)
@pytest.mark.timeout(1)
def test_hang_after_slow_start(ctx):
    if ctx.rank == 1:
        time.sleep(600)
    dist.barrier()


@distributed(world_size=2)
def test_rank_prints_a_huge_line(ctx):
    if ctx.rank == 1:
        print("x" * 5_000_000, flush=True)
        print("the end of rank 1's output", flush=True)
        raise ValueError("after a huge line")


@distributed(world_size=2)
def test_rank1_dies_just_after_returning(ctx):
    dist.barrier()
    if ctx.rank == 1:  # the body returns; a process it does not own (no thread or child of this
        # rank's: the harness would refuse those) ends the rank 0.5 s later
        with open(DYING_RANK, "w") as f:  # the session's folder: test_pause_between_tests waits for it
            f.write(str(os.getpid()))
        os.system(f"(sleep 0.5; kill -s TERM {os.getpid()}) >/dev/null 2>&1 &")


DYING_RANK = "rank-dying-after-returning.pid"


def _ended(pid: int) -> bool:
    """Gone, or a zombie its pool has not reaped yet."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def test_pause_between_tests():
    # not distributed: the pool sits idle meanwhile, until a rank killed after its test has died
    # (however loaded the machine, so that the death happens inside this session), and 0.3 s more
    if os.path.exists(DYING_RANK):
        with open(DYING_RANK) as f:
            pid = int(f.read())
        deadline = time.monotonic() + 60
        while not _ended(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
    time.sleep(0.3)


@distributed(world_size=2)
def test_runs_on_fresh_ranks_after_an_idle_death(ctx):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2.0


@distributed(world_size=2)
def test_starts_on_no_rank_beside_one_that_died_idle(ctx):
    # Rank 1 of the pool is killed as this test is handed out (test_faults.DEATH_AT_HAND_OUT): its
    # live peer must wait at the gate, not run the body; the test then runs on fresh ranks. So this
    # body's file holds the lines of one run only.
    runs = os.path.join(os.path.dirname(__file__), "body_starts.txt")
    with open(runs, "a") as f:
        f.write(f"rank {ctx.rank} pid {os.getpid()}\n")
    dist.barrier()
    with open(runs) as f:
        lines = f.read().splitlines()
    assert len(lines) == ctx.world_size, f"the body started {len(lines)} times: {lines}"
