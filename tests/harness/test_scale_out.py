"""Scaling out: `pytest -n gpus` with device leasing (simulated devices), and multi-node torchrun."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from itertools import combinations
from pathlib import Path

import pytest

from shardcheck.harness import devices, distributed, xdist_support
from shardcheck.harness.worker import cpu_of, xdist_worker

LEASE_BODIES = '''
import json, os, time
import torch, torch.distributed as dist
from shardcheck.harness import distributed

def _hold(ctx):
    start = time.time()
    t = torch.ones(1)
    dist.all_reduce(t)  # a rendezvous shared with another worker's pool would not sum to ws
    assert t.item() == ctx.world_size
    lease = os.environ["CUDA_VISIBLE_DEVICES"].split(",")
    ctx.assert_equal_across_ranks(lease, "leased devices")
    time.sleep(1.0)
    store = dist.distributed_c10d._get_default_store().underlying_store.path
    ctx.record("lease", {"devices": lease, "start": start, "end": time.time(), "store": store,
                         "worker": os.environ.get("PYTEST_XDIST_WORKER")})

@distributed(world_size=[4, 2, 2, 1])
def test_hold(ctx):
    _hold(ctx)

@distributed(world_size=2)
def test_hold_more(ctx):
    _hold(ctx)
'''

RECORDER = '''
import json, os
def pytest_runtest_logreport(report):
    if report.when == "call" and "PYTEST_XDIST_WORKER" not in os.environ:  # the controller only
        with open("leases.jsonl", "a") as f:
            f.write(json.dumps({"id": report.nodeid, "outcome": report.outcome,
                                "text": report.longreprtext, **dict(report.user_properties)}) + "\\n")
'''


def _clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SHARDCHECK_", "PYTEST_XDIST", "TORCHELASTIC", "CUDA_VISIBLE"))}
    env.update(extra)
    return env


# --- ranks on the CPUs --------------------------------------------------------------------------

def test_concurrent_worlds_sit_side_by_side_on_the_cpus():
    """Each xdist worker's world takes the next CPUs: four workers' worlds of 4 on 16 CPUs one CPU each
    (not all sixteen ranks on the first four); more ranks than CPUs alternate, as before."""
    sixteen = list(range(16))
    assert sorted(cpu_of(r, 4, w, sixteen) for w in range(4) for r in range(4)) == sixteen
    assert [cpu_of(r, 4, w, [0, 1]) for w in range(2) for r in range(4)] == [0, 1] * 4
    assert [cpu_of(r, 3, 1, [5, 7, 9, 11]) for r in range(3)] == [11, 5, 7]  # by position in the allowed set


@distributed(world_size=3)
def test_a_gloo_rank_of_a_world_of_3_is_pinned_where_cpu_of_says(ctx):
    if ctx.backend != "gloo" or ctx.mode not in ("pool", "spawn"):
        pytest.skip(f"{ctx.backend} {ctx.mode} ranks are not gloo processes started by the harness: nothing is pinned")
    if os.environ.get("SHARDCHECK_PIN_RANKS") == "0" or not hasattr(os, "sched_getaffinity"):
        pytest.skip("pinning is off (SHARDCHECK_PIN_RANKS=0) or not Linux")
    allowed = sorted(os.sched_getaffinity(os.getppid()))  # the session's process, never pinned
    assert os.sched_getaffinity(0) == {cpu_of(ctx.rank, 3, xdist_worker(), allowed)}, (xdist_worker(), allowed)


# --- `-n gpus` -----------------------------------------------------------------------------------

def test_dash_n_gpus_is_one_worker_per_device(pytester, monkeypatch):
    pytest.importorskip("xdist")
    monkeypatch.setenv(devices.FAKE_ENV, "8")
    config = pytester.parseconfig("-n", "gpus")
    assert config.option.numprocesses == 8
    assert xdist_support.header_line() == "-n gpus: 8 workers, one per visible device (8 fake GPUs)"
    assert pytester.parseconfig("-n", "3").option.numprocesses == 3  # other values untouched


def test_dash_n_gpus_without_gpus_falls_back_to_half_the_cores(pytester, monkeypatch):
    pytest.importorskip("xdist")
    monkeypatch.setenv(devices.FAKE_ENV, "0")
    cores = len(os.sched_getaffinity(0))
    assert pytester.parseconfig("-n", "gpus").option.numprocesses == max(1, cores // 2)
    assert xdist_support.header_line().startswith("-n gpus: no GPU visible;")


# --- the lease ---------------------------------------------------------------------------------

@pytest.fixture
def fake4(monkeypatch, tmp_path):
    monkeypatch.setenv(devices.FAKE_ENV, "4")
    monkeypatch.setenv(devices.DIR_ENV, str(tmp_path))


def test_leases_are_disjoint_and_a_full_machine_waits(fake4):
    with devices.lease(2, timeout_s=1) as first, devices.lease(2, timeout_s=1) as second:
        assert len(first) == len(second) == 2 and not set(first) & set(second)
        with pytest.raises(devices.LeaseTimeout, match="could not lease 1 devices within 0.2 s"):
            with devices.lease(1, timeout_s=0.2):
                pass
    with devices.lease(4, timeout_s=1) as everything:  # all released on exit
        assert sorted(everything) == ["fake0", "fake1", "fake2", "fake3"]


def test_lease_prefers_the_devices_a_pool_sits_on(fake4):
    with devices.lease(2, timeout_s=1, prefer=["fake3", "fake1"]) as got:
        assert got == ["fake3", "fake1"]  # rank order kept: the pool is reused as it is
    with devices.lease(1, timeout_s=1, prefer=["fake2"]), \
            devices.lease(2, timeout_s=1, prefer=["fake2", "fake3"]) as partly:
        assert partly[0] == "fake3" and "fake2" not in partly


def test_lease_ids_are_the_outer_cuda_visible_devices(monkeypatch, tmp_path):
    from shardcheck.harness import cuda

    monkeypatch.setattr(cuda, "device_count", lambda: 2)  # what NVML counts under CUDA_VISIBLE_DEVICES=5,7
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    monkeypatch.setenv(devices.DIR_ENV, str(tmp_path))
    monkeypatch.delenv(devices.FAKE_ENV, raising=False)
    with devices.lease(1, timeout_s=1) as one, devices.lease(1, timeout_s=1) as other:
        assert {*one, *other} == {"5", "7"}  # the ranks get CUDA_VISIBLE_DEVICES=5 or 7
    assert sorted(p.name for p in tmp_path.glob("device-*.lock")) == ["device-5.lock", "device-7.lock"]


def test_concurrent_tests_never_share_a_device(tmp_path):
    """Two xdist workers, 4 fake devices, tests at world sizes 4/2/2/2/1 holding their lease for 1 s:
    tests running at the same time hold disjoint devices, and every pool has its own rendezvous."""
    pytest.importorskip("xdist")
    (tmp_path / "test_lease.py").write_text(LEASE_BODIES)
    (tmp_path / "conftest.py").write_text(RECORDER)
    (tmp_path / "tmp").mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "gpus", "--maxprocesses", "2",
         "test_lease.py"], cwd=tmp_path, capture_output=True, text=True, timeout=180,
        env=_clean_env(**{devices.FAKE_ENV: "4", "TMPDIR": str(tmp_path / "tmp")}))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    left = [p.name for p in (tmp_path / "tmp").glob("shardcheck-*")]
    assert left == [], f"the session left {left} behind"  # the fake devices' lease folder included
    assert "-n gpus: 4 workers, one per visible device (4 fake GPUs)" in proc.stdout
    rows = [json.loads(line) for line in (tmp_path / "leases.jsonl").read_text().splitlines()]
    leases = [row["lease"]["0"][0] for row in rows]
    assert len(leases) == 5 and {lease["worker"] for lease in leases} == {"gw0", "gw1"}
    for row, lease in zip(rows, leases):
        assert len(lease["devices"]) == int(re.search(r"\[ws(\d+)", row["id"]).group(1))
        assert "shardcheck-pool-" in lease["store"]
    concurrent = 0
    for a, b in combinations(leases, 2):
        if a["start"] < b["end"] and b["start"] < a["end"]:  # ran at the same time
            concurrent += 1
            assert not set(a["devices"]) & set(b["devices"]), (a, b)
            assert a["store"] != b["store"], (a, b)
    assert concurrent >= 1, leases  # the workers did run tests side by side


# --- multi-node torchrun -----------------------------------------------------------------------

NODE_BODIES = '''
import torch, torch.distributed as dist
from shardcheck.harness import distributed

@distributed(world_size=[1, 2])
def test_all_reduce(ctx):
    t = torch.ones(1)
    dist.all_reduce(t, group=ctx.group)
    assert t.item() == ctx.world_size

@distributed(world_size=2)
def test_fails_on_node_1_only(ctx):
    assert ctx.rank == 0, "node 1 disagrees"
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun is not on PATH")
def test_two_torchrun_nodes_agree_and_only_node0_reports(tmp_path: Path):
    (tmp_path / "test_nodes.py").write_text(NODE_BODIES)
    port = _free_port()
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
         "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
         "-m", "pytest", "-p", "no:cacheprovider", "-v", "test_nodes.py"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_clean_env())
        for node in (0, 1)]
    outs = [agent.communicate(timeout=240) for agent in agents]
    (out0, err0), (out1, err1) = outs
    assert agents[0].returncode != 0, out0 + err0[-2000:]  # the agreed verdict: one test failed
    assert "1 failed, 2 passed" in out0, out0 + err0[-2000:]
    assert "rank 1: AssertionError: node 1 disagrees (1 of 2 ranks failed)" in out0
    ran = re.findall(r"^test_nodes.py::(\S+) (PASSED|FAILED)", out0, re.M)
    assert ran == [("test_all_reduce[ws1]", "PASSED"), ("test_all_reduce[ws2]", "PASSED"),
                   ("test_fails_on_node_1_only[ws2]", "FAILED")], out0
    for word in ("PASSED", "FAILED", "passed", "failed", "test_nodes.py"):
        assert word not in out1, out1  # node 1's pytest reports nothing
