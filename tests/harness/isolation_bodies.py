"""Test bodies that each change one piece of a rank process's state and return, run in order by
test_isolation.py in a child pytest session: after each `test_<n>_<leak>` comes the innocent
`test_<n>b_next_...` that must find a clean process (restored, or fresh ranks) and pass.
"""

import os
import signal
import subprocess
import threading
import time
import warnings

import pytest
import torch
import torch.distributed as dist

from shardcheck.harness import distributed

KEEP = []  # what a leaking body hands to the module, so that nothing closes or joins it for it


def _one_all_reduce(ctx):
    t = torch.ones(1, device=ctx.device)
    dist.all_reduce(t)
    assert t.item() == ctx.world_size


@distributed(world_size=2)
def test_1_changes_settings(ctx):
    os.environ["SHARDCHECK_LEAKED"] = "1"
    os.chdir("/")
    torch.set_num_threads(3)
    torch.autograd.set_detect_anomaly(True)
    torch.use_deterministic_algorithms(True)
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    torch.set_float32_matmul_precision("medium")
    warnings.simplefilter("error")


@distributed(world_size=2)
def test_1b_next_finds_them_restored(ctx):
    assert "SHARDCHECK_LEAKED" not in os.environ
    assert os.getcwd() != "/"
    assert torch.get_num_threads() != 3
    assert not torch.is_anomaly_enabled()
    assert not torch.are_deterministic_algorithms_enabled()
    assert torch.get_default_dtype() == torch.float32
    assert torch.is_grad_enabled()
    assert torch.get_float32_matmul_precision() == "highest"
    warnings.warn("only a warning")
    _one_all_reduce(ctx)


@distributed(world_size=2)
def test_2_unmatched_async_collective(ctx):
    if ctx.rank == 0:
        dist.all_reduce(torch.ones(1), async_op=True)  # rank 1 never issues it


@distributed(world_size=2)
def test_2b_next_matches_its_own_collectives(ctx):
    _one_all_reduce(ctx)


@distributed(world_size=2)
def test_2c_keeps_an_unmatched_handle(ctx):
    if ctx.rank == 0:
        KEEP.append(dist.broadcast(torch.ones(1), src=0, async_op=True))  # rank 1 never joins


@distributed(world_size=2)
def test_2d_next(ctx):
    _one_all_reduce(ctx)


@distributed(world_size=4)
def test_3_unmatched_on_a_sub_group(ctx):
    mesh = ctx.mesh((2, 2), ("replicate", "shard"))
    if ctx.rank == 3:
        dist.broadcast(torch.ones(1), group=mesh.get_group("shard"), group_src=0, async_op=True)


@distributed(world_size=4)
def test_3b_next_on_the_same_sub_group(ctx):
    mesh = ctx.mesh((2, 2), ("replicate", "shard"))
    t = torch.ones(1)
    dist.all_reduce(t, group=mesh.get_group("shard"))
    assert t.item() == 2


@distributed(world_size=3)
def test_4_point_to_point_is_not_a_collective(ctx):
    t = torch.arange(3.0)
    if ctx.rank == 0:  # rank 0 makes two sends, ranks 1 and 2 one receive each: all matched
        dist.send(t, 1)
        ops = [dist.P2POp(dist.isend, t, 2)]
    else:
        ops = [dist.P2POp(dist.irecv, t, 0)] if ctx.rank == 2 else []
        if ctx.rank == 1:
            dist.recv(t, 0)
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()
    assert t.tolist() == [0.0, 1.0, 2.0]


@distributed(world_size=2)
def test_5_leaves_a_thread(ctx):
    threading.Thread(target=time.sleep, args=(60,), name="left-behind", daemon=True).start()


@distributed(world_size=2)
def test_5b_next(ctx):
    _one_all_reduce(ctx)


@distributed(world_size=2)
def test_6_leaves_a_file_open(ctx):
    KEEP.append(open(os.path.join(os.environ.get("SHARDCHECK_LEAK_DIR", "/tmp"),
                                  f"left-open-rank{ctx.rank}.txt"), "w"))


@distributed(world_size=2)
def test_6b_next(ctx):
    _one_all_reduce(ctx)


@distributed(world_size=2)
def test_7_leaves_a_child_process(ctx):
    if ctx.rank == 1:
        KEEP.append(subprocess.Popen(["sleep", "60"]))


@distributed(world_size=2)
def test_7b_next(ctx):
    _one_all_reduce(ctx)


@distributed(world_size=2)
def test_8_leaves_an_alarm(ctx):
    if ctx.rank == 0:
        signal.alarm(30)


@distributed(world_size=2)
def test_8b_next(ctx):
    _one_all_reduce(ctx)


@distributed(world_size=2)
def test_9_destroys_the_default_group(ctx):
    dist.destroy_process_group()


@distributed(world_size=2)
def test_9b_next(ctx):
    _one_all_reduce(ctx)


@distributed(world_size=2)
def test_10_joins_its_thread_and_closes_its_file(ctx):
    thread = threading.Thread(target=time.sleep, args=(0.05,))
    thread.start()
    with open(os.devnull) as f:
        f.read()
    thread.join()
    _one_all_reduce(ctx)


@distributed(world_size=2)
@pytest.mark.parametrize("step", range(3))
def test_11_a_clean_test_keeps_its_ranks(ctx, step):
    ctx.record("pid", os.getpid())
    _one_all_reduce(ctx)


@distributed(world_size=2)
def test_12_a_handle_on_its_own_output_is_not_a_leak(ctx):
    KEEP.append(open("/dev/stdout", "w"))  # what a library's log handler does on first use
    _one_all_reduce(ctx)


@distributed(world_size=2)
def test_13_leaves_a_monkeypatch(ctx):
    import torch.nn.functional as F

    F.relu = lambda x, inplace=False: x  # never restored


@distributed(world_size=2)
def test_13b_next(ctx):
    import torch.nn.functional as F

    assert F.relu(torch.tensor([-1.0])).item() == 0.0
    _one_all_reduce(ctx)


@distributed(world_size=2)
def test_14_imports_a_submodule_and_patches_within_a_context(ctx):
    from unittest import mock

    import torch.distributed.checkpoint  # noqa: F401  (adds an attribute to torch.distributed)

    with mock.patch.object(dist, "barrier", lambda *a, **k: None):
        dist.barrier()
    _one_all_reduce(ctx)
