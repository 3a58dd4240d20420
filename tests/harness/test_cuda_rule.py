"""The rule of shardcheck/harness/cuda.py: a process that forks ranks never initialises the CUDA
driver, and ranks that compute on the CPU see no CUDA device.

On a GPU machine a forked child of a process that asked CUDA anything cannot use CUDA ("CUDA error:
initialization error" inside every optimizer step: 361 of the README command's 523 cells failed on
an H200). A CPU-only machine cannot show the failure, so the first test spies on torch's CUDA entry
points (tests/harness/cuda_spy.py) in the README's main command, cut to a few families, and fails
on any call made in the process that forks the ranks."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import warm_python
from shardcheck.harness import cuda, distributed
from shardcheck.harness.pool import start_method

HERE = Path(__file__).parent


def test_the_main_command_never_asks_cuda_in_the_process_that_forks_ranks(tmp_path):
    out = tmp_path / "calls.json"
    env = {**os.environ, "CUDA_SPY_OUT": str(out),
           "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    done = warm_python.run(
        ["-m", "shardcheck.conformance.cli", "run", "--family", "train_parity,checkpoint",
         "--world-sizes", "2", "-k", "not explore", "-o", str(tmp_path / "r.json"), "--", "-p", "cuda_spy"],
        cwd=tmp_path, env=env, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert " passed" in done.stdout + done.stderr
    calls = json.loads(out.read_text())
    assert calls == [], "the process that forks ranks called into CUDA:\n" + "\n".join(
        f"  {c['call']} from {c['from']}" for c in calls)


@distributed(world_size=2, backend="gloo")
def test_a_gloo_rank_sees_no_cuda_device(ctx):
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
    assert not torch.cuda.is_available()


def test_the_visible_count_follows_cuda_visible_devices():
    assert cuda.visible_count(4, None) == 4
    assert cuda.visible_count(4, "") == 0
    assert cuda.visible_count(4, "1,3") == 2
    assert cuda.visible_count(4, "1,7,2") == 1  # the runtime stops at the first device that does not exist
    assert cuda.visible_count(2, "GPU-5e3c,0") == 2


def test_a_process_with_the_driver_loaded_forks_no_ranks(tmp_path, monkeypatch):
    """Once the driver is in this process (its library mapped), pools start from a fork server."""
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libcudart.so.12\n")
    assert not cuda.library_mapped(str(maps))
    maps.write_text("7f00-7f01 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libcuda.so.535.104.05\n")
    assert cuda.library_mapped(str(maps))
    monkeypatch.delenv("SHARDCHECK_START_METHOD", raising=False)
    monkeypatch.setattr(cuda, "driver_touched", lambda: True)
    assert start_method("gloo") == "forkserver"
    monkeypatch.setattr(cuda, "driver_touched", lambda: False)
    assert start_method("gloo") == "fork"
    assert start_method("nccl") == "forkserver"


@pytest.mark.skipif(cuda.built(), reason="a build of torch without CUDA")
def test_a_build_without_cuda_counts_no_device_and_touches_nothing():
    assert cuda.device_count() == 0 and cuda.device_names() == [] and not cuda.driver_touched()
