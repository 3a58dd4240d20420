"""External mode for real: ranks started by torchrun, each running the same pytest session."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BODIES = '''
import torch, torch.distributed as dist
from shardcheck.harness import distributed

@distributed(world_size=[1, 2, 4])
def test_all_reduce(ctx):
    t = torch.ones(1)
    dist.all_reduce(t, group=ctx.group)
    assert t.item() == ctx.world_size

@distributed(world_size=2)
def test_fails_on_rank_1_only(ctx):
    assert ctx.rank == 0, "rank 1 disagrees"
'''


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun is not on PATH")
def test_torchrun_ranks_agree_and_only_rank0_reports(tmp_path: Path):
    (tmp_path / "test_ext.py").write_text(BODIES)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_ext.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=240)
    out = proc.stdout
    assert proc.returncode != 0, out
    # one report (rank 0's), with the verdict agreed across both ranks
    assert out.count("1 failed, 2 passed, 1 skipped") == 1, out + proc.stderr[-2000:]
    assert "rank 1: AssertionError: rank 1 disagrees (1 of 2 ranks failed)" in out
    assert "needs world size 4; the launcher started 2 ranks" not in out  # skips stay quiet with -q
