"""torch's engines with ranks as threads (`--shardcheck-backend threaded`): what torch keeps per
process must not make a cell fail for a reason that is not the engine's bug, and what cannot run
on threads is unsupported, with its reason."""

import json
import os
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


DUMP = '''
import json, os
import pytest

def _cells(items):
    return [[i.nodeid, {k: repr(v) for k, v in getattr(i, "callspec", None) and i.callspec.params.items() or ()}]
            for i in items]

@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):  # before tests/conftest.py's hook leaves threaded cells out
    with open(os.environ["CELLS_OUT"] + ".every", "w") as f:
        json.dump(_cells(items), f)

def pytest_collection_finish(session):
    with open(os.environ["CELLS_OUT"], "w") as f:
        json.dump(_cells(session.items), f)
'''


def test_the_test_command_runs_every_gloo_cell_and_every_pair_of_values_on_threads(tmp_path):
    """tests/conftest.py: of the README test command's threaded cells, each check function keeps a set
    that holds every pair of its parameters' values (world size included); every gloo cell stays."""
    (tmp_path / "dump_cells.py").write_text(DUMP)
    out = tmp_path / "cells.json"
    proc = warm_python.run(["-m", "pytest", "--collect-only", "-q", "-p", "dump_cells", "--shardcheck-backend",
                            "gloo,threaded"], cwd=ROOT, timeout=300,
                           env={**os.environ, "PYTHONPATH": str(tmp_path), "CELLS_OUT": str(out)})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    kept, every = json.loads(out.read_text()), json.loads((tmp_path / "cells.json.every").read_text())

    def pairs(cells, backend):
        out = set()
        for nodeid, params in cells:
            if params.get("shardcheck_backend") != repr(backend) or "conformance/checks/" not in nodeid:
                continue
            values = sorted((k, v) for k, v in params.items() if k not in ("impl", "shardcheck_backend"))
            fn = nodeid.split("[")[0]
            out |= {(fn,)} | {(fn, kv) for kv in values} | {(fn, a, b) for a in values for b in values if a < b}
        return out

    assert {n for n, p in every if p.get("shardcheck_backend") != "'threaded'"} == \
        {n for n, p in kept if p.get("shardcheck_backend") != "'threaded'"}
    assert pairs(kept, "threaded") == pairs(every, "threaded")
    assert len(kept) < len(every)
