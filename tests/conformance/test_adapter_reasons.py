"""A reason for every unsupported cell: each built-in adapter explains every capability it does not
declare, in its manifest's `[unsupported]` table, and the run and the report show that reason."""

import json
import tomllib
import types
from pathlib import Path

import pytest

from shardcheck.conformance.adapters import every_builtin, load
from shardcheck.conformance.expectations import manifest
from shardcheck.conformance.protocol.capabilities import CAPABILITIES

import warm_python

ROOT = Path(__file__).resolve().parents[2]


def _every_variant():
    names, _left_out = every_builtin()  # the engines installed here (CI's engine steps run the rest)
    for name in names:
        adapter = load(name)
        yield adapter
        for variant in getattr(type(adapter), "variants", {}) or {}:
            if "[" not in name and variant != "config":
                yield load(f"{name}[{variant}]")


@pytest.mark.parametrize("adapter", list(_every_variant()), ids=lambda a: a.name)
def test_every_capability_left_out_has_a_reason(adapter):
    assert manifest.unexplained(adapter) == [], f"{adapter.name}: add them to {manifest.path_of(adapter)} [unsupported]"


@pytest.mark.parametrize("path", sorted(manifest.HERE.glob("*.toml")), ids=lambda p: p.stem)
def test_every_manifest_reason_names_a_capability_in_one_line(path):
    table = tomllib.loads(path.read_text()).get("unsupported", {})
    assert table, f"{path.name} has no [unsupported] table"
    assert manifest.unsupported(types.SimpleNamespace(name=path.stem)) == table  # validated: keys, one line each
    assert set(table) <= set(CAPABILITIES)


def test_a_capability_left_out_without_a_reason_is_named(tmp_path):
    (tmp_path / "m.toml").write_text('[unsupported]\nfull_shard = "replicates only"\n')
    adapter = types.SimpleNamespace(name="mine", capabilities=frozenset(CAPABILITIES) - {"full_shard", "no_sync"},
                                    expectations=str(tmp_path / "m.toml"))
    assert manifest.unexplained(adapter) == ["no_sync"]
    assert manifest.why_not(adapter, "full_shard") == "replicates only"
    assert manifest.why_not(adapter, "no_sync") == manifest.NO_REASON
    (tmp_path / "m.toml").write_text('[unsupported]\nful_shard = "typo"\n')
    with pytest.raises(manifest.ManifestError, match="ful_shard: a key must be a capability"):
        manifest.unsupported(adapter)


def test_the_run_and_the_report_give_each_unsupported_cell_its_reason(tmp_path):
    out = tmp_path / "r.json"
    proc = warm_python.run(["-m", "shardcheck.conformance.cli", "run", "--impl", "ddp", "--family", "sharding",
                            "--world-sizes", "2", "-o", str(out)], cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    reason = manifest.unsupported(load("ddp"))["full_shard"]
    assert f"ddp: unsupported: `full_shard` is needed by 1 cell (1 of them need nothing else): {reason}" in proc.stdout
    report = json.loads(out.read_text())
    assert any(f"full_shard ({reason})" in str(text) for text in report["texts"])

