"""torch's engines with ranks as threads (`--shardcheck-backend threaded`): what torch keeps per
process must not make a cell fail for a reason that is not the engine's bug, and what cannot run
on threads is unsupported, with its reason."""

from pathlib import Path

import warm_python

from shardcheck.conformance.adapters.torch_fsdp1 import ON_THREADS
from shardcheck.conformance.report import reading

ROOT = Path(__file__).resolve().parents[2]
BEHAVIOUR = ROOT / "shardcheck" / "conformance" / "checks" / "behaviour"


def _cells(tmp_path, impl: str, check: str, keyword: str) -> list[dict]:
    """The cells of `check` selected by `keyword`, run on threads in a process of their own."""
    proc = warm_python.run(["-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", str(BEHAVIOUR / check),
                            "-k", keyword, "--shardcheck-impl", impl, "--shardcheck-backend", "threaded",
                            "--shardcheck-rank-timeout", "30", "--shardcheck-report", str(tmp_path / "r.json")],
                           cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    return reading.load(tmp_path / "r.json")["cells"]


def test_fsdp2_loss_scaling_on_threads_in_a_world_after_the_first(tmp_path):
    """torch's ShardedGradScaler takes `dist.group.WORLD` as its default group when its module is
    first imported: imported by a rank thread of the first world, every later world's scaler
    all-reduced over a group that was gone ("is not initialized in the world group map")."""
    cells = _cells(tmp_path, "torch-fsdp2", "test_loss_scaling.py", "FULL_SHARD and inf")
    assert sorted(c["world_size"] for c in cells) == [2, 4] and {c["outcome"] for c in cells} == {"passed"}, cells


def test_fsdp1_checkpoints_on_threads_are_unsupported_with_the_reason(tmp_path):
    cells = _cells(tmp_path, "torch-fsdp1", "test_checkpoint.py", "test_resume and ws2-FULL_SHARD")
    assert [c["outcome"] for c in cells] == ["unsupported"] and ON_THREADS in cells[0]["message"], cells
