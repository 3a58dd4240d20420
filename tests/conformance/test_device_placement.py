"""Every check builds its models, batches and yardsticks on the rank's device (ctx.device): the
api families that build their own models (seeds' CUDAInitMode), run with the device guard
(shardcheck/harness/device_guard.py), pass as they pass without it. On 58926ad, on an H200 with
threaded ranks on cuda:0, 278 of these cells failed with "Expected all tensors to be on the same
device" (../shared/gpu-evidence); here the guard names the same lines. Under the guard the grad
scaler's seed cells of a model built on the host (device_never, device_after) run too: on an H200 at
ac96bb0 they failed, 36 cells, because two specs named no mesh (the yardstick computed on the host);
the guard fails them here (reports/gpu/README.md). The whole reference matrix under the guard:
`SHARDCHECK_DEVICE_GUARD=1 shardcheck run` (523 passed, docs/harness.md).

The guard's run needs every code path of the bodies, not every cell judged again (the suite's own
items judge them): of each check function's cells it runs those that hold every pair of its
parameters' values (tests/conformance/pairwise_cells.py): 83 of the 152 at world size 2, 41 -> 20
CPU-s. On the checks of 26761a4 before their fix it fails the same five check functions as the
whole run (23 cells of the whole run's 48)."""

from __future__ import annotations

import os

import warm_python

HERE = os.path.dirname(os.path.abspath(__file__))


def test_the_api_checks_build_on_the_rank_device(tmp_path):
    path = os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "SHARDCHECK_DEVICE_GUARD": "1", "PYTHONPATH": path}
    done = warm_python.run(
        ["-m", "shardcheck.conformance.cli", "run", "--family", "clip_grad,grad_scaler,comm_hooks",
         "--world-sizes", "2", "-o", str(tmp_path / "r.json"), "--", "-p", "pairwise_cells"],
        cwd=tmp_path, env=env, timeout=400)
    out = done.stdout + done.stderr
    assert "device guard" not in out, out[-4000:]
    assert "pairwise_cells: " in out, out[-4000:]
    assert done.returncode == 0, out[-4000:]
    assert " passed" in out and " failed" not in out
