"""Every check builds its models, batches and yardsticks on the rank's device (ctx.device): the
api families that build their own models (seeds' CUDAInitMode), run with the device guard
(shardcheck/harness/device_guard.py), pass as they pass without it. On 58926ad, on an H200 with
threaded ranks on cuda:0, 278 of these cells failed with "Expected all tensors to be on the same
device" (../shared/gpu-evidence); here the guard names the same lines. Under the guard the grad
scaler's seed cells of a model built on the host (device_never, device_after) run too: on an H200 at
ac96bb0 they failed, 36 cells, because two specs named no mesh (the yardstick computed on the host); the
guard fails the same 16 world-size-2 cells here (reports/gpu/README.md). The whole reference matrix
under the guard: `SHARDCHECK_DEVICE_GUARD=1 shardcheck run` (523 passed, docs/harness.md)."""

from __future__ import annotations

import os

import warm_python


def test_the_api_checks_build_on_the_rank_device(tmp_path):
    env = {**os.environ, "SHARDCHECK_DEVICE_GUARD": "1"}
    done = warm_python.run(
        ["-m", "shardcheck.conformance.cli", "run", "--family", "clip_grad,grad_scaler,comm_hooks",
         "--world-sizes", "2", "-o", str(tmp_path / "r.json")], cwd=tmp_path, env=env, timeout=400)
    out = done.stdout + done.stderr
    assert "device guard" not in out, out[-4000:]
    assert done.returncode == 0, out[-4000:]
    assert " passed" in out and " failed" not in out
