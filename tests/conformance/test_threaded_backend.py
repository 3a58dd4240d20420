"""torch's engines with ranks as threads (`--shardcheck-backend threaded`): what torch keeps per
process must not make a cell fail for a reason that is not the engine's bug, and what cannot run
on threads is unsupported, with its reason."""

from pathlib import Path

import warm_python

from shardcheck.conformance.adapters.torch_fsdp1 import ON_THREADS
from shardcheck.conformance.report import reading

ROOT = Path(__file__).resolve().parents[2]
BEHAVIOUR = ROOT / "shardcheck" / "conformance" / "checks" / "behaviour"


def _cells(tmp_path, impl: str, check: str, keyword: str, cwd: Path = ROOT) -> list[dict]:
    """The cells of `check` selected by `keyword`, run on threads in a process of their own."""
    proc = warm_python.run(["-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", str(BEHAVIOUR / check),
                            "-k", keyword, "--shardcheck-impl", impl, "--shardcheck-backend", "threaded",
                            "--shardcheck-rank-timeout", "30", "--shardcheck-report", str(tmp_path / "r.json")],
                           cwd=cwd, timeout=300)
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


REFUSES_TO_SAVE = '''
from shardcheck.conformance.adapters.reference import ReferenceAdapter
from shardcheck.conformance.protocol import Unsupported

class RefusesToSave(ReferenceAdapter):
    name = "refuses-to-save"

    def save_checkpoint(self, model, optimizer, scaler, path):
        raise Unsupported("no checkpoints here")
'''


def test_a_refusal_on_the_ranks_of_one_phase_is_every_ranks_outcome(tmp_path):
    """Resharding 2 -> 4 saves on ranks 0 and 1 while 2 and 3 wait: an adapter refusing the save
    there makes the cell unsupported with its reason, not failed (ranks left waiting for it)."""
    (tmp_path / "refusing.py").write_text(REFUSES_TO_SAVE)
    [cell] = _cells(tmp_path, "refusing:RefusesToSave", "test_checkpoint_reshard.py", "FULL_SHARD and 2to4", cwd=tmp_path)
    assert cell["outcome"] == "unsupported" and "no checkpoints here" in str(cell), cell
