"""`shardcheck explore` (shardcheck/conformance/explore/): drawn configurations, their JSON form, manifest
matching, and end to end with a fixed seed: the FSDP2 empty-shard inf-norm failure (F9) rediscovered
and shrunk unaided, a mutant that only explore kills, replay of a finding.

Searches against mutants run in their own processes (a mutant patches reference_impl process-wide).
`SHARDCHECK_EXPLORE_MUTANTS=1` also runs explore against every behaviour-level mutant the fixed
matrix kills (about a minute per mutant on 2 busy cores).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

import warm_python
from hypothesis import HealthCheck, given, settings

from shardcheck.conformance.adapters import load
from shardcheck.conformance.explore import findings, strategies
from shardcheck.conformance.explore.config import Config, dumps, from_json, loads, to_json
from shardcheck.conformance.explore.run import Outcome, signature
from shardcheck.conformance.explore.search import Limits, explore

ROOT = Path(__file__).resolve().parents[2]
REFERENCE_CAPS = load("reference").capabilities
F9_ERROR = "cannot compute the infinity norm on an empty tensor"
QUICK = settings(max_examples=60, deadline=None, database=None, derandomize=True,
                 suppress_health_check=list(HealthCheck))


@QUICK
@given(strategies.configs(REFERENCE_CAPS))
def test_config_json_round_trip(config):
    """Every drawn configuration survives to_json -> JSON text -> from_json unchanged."""
    assert loads(dumps(config)) == config
    assert from_json(json.loads(json.dumps(to_json(config)))) == config


def _builtin_only(value) -> bool:
    if type(value) in (tuple, list):
        return all(_builtin_only(v) for v in value)
    if type(value) is dict:
        return all(_builtin_only(k) and _builtin_only(v) for k, v in value.items())
    return value is None or type(value) in (str, int, float, bool)


def test_config_json_is_builtin_types_only():
    """A finding's config travels in the cell's user_properties through pytest-xdist (execnet
    serializes builtin types only): a Strategy member, a str subclass, crashed a --workers run."""
    from shardcheck.strategy import Strategy

    config = Config(world_size=2, widths=(2, 2), bias=(False,), strategy=Strategy.NO_SHARD,
                    units=((0, Strategy.FULL_SHARD),), max_norm=1.0, norm_type=math.inf)
    out = to_json(config)
    assert _builtin_only(out), out
    assert out["strategy"] == "NO_SHARD" and from_json(out) == config


@QUICK
@given(strategies.configs(load("ddp").capabilities))
def test_draws_stay_within_declared_capabilities(config):
    """DDP declares NO_SHARD and no nested units: no other strategy, no unit, no 2-D mesh is drawn."""
    assert config.strategies == {"NO_SHARD"} and not config.units
    assert config.mesh is None


def test_facts_use_torch_chunking():
    """4 rows over 3 ranks split 2, 2, 0: an empty shard although rows >= ranks (found by explore)."""
    base = dict(bias=(False,), max_norm=1.0, norm_type=math.inf)
    assert Config(world_size=3, widths=(2, 4), **base).facts()["empty_shard"]
    assert not Config(world_size=3, widths=(2, 3), **base).facts()["empty_shard"]
    assert Config(world_size=2, widths=(2, 1), **base).facts()["norm_type"] == "inf"
    assert not Config(world_size=4, widths=(2, 1), strategy="NO_SHARD", **base).facts()["empty_shard"]


def test_signature_is_free_of_ranks_steps_and_values():
    head = ("rank 1: AssertionError: step 2 gradients: 1 mismatch(es) beyond rtol=1.3e-06 atol=1e-05; "
            "max abs error 2.04e-05 (2 of 3 ranks failed; then, as a consequence, rank 0)")
    assert signature(head) == "AssertionError: step N gradients"
    mesh = "rank 0: ValueError: All operands in aten.stack.default must have the same mesh, but got X (1 of 1 ranks failed)"
    assert signature(mesh) == "ValueError: All operands in aten.stack.default must have the same mesh"


def test_manifest_entry_needs_facts_and_error():
    """torch-fsdp2's F9 entry matches an inf-norm empty-shard failure only: other facts or another
    error are not excused."""
    entries = findings.manifest_entries(load("torch-fsdp2"))
    f9 = Config(world_size=2, widths=(3, 1), bias=(False,), max_norm=1.0, norm_type=math.inf)
    failed = Outcome("failed", f"rank 1: RuntimeError: _foreach_norm {F9_ERROR}", "sig")
    assert findings.known_entry(entries, f9, failed)["finding"] == "F9"
    other_error = Outcome("failed", "AssertionError: step 0 gradients: ...", "sig")
    assert findings.known_entry(entries, f9, other_error) is None
    no_empty_shard = Config(world_size=2, widths=(3, 2), bias=(False,), max_norm=1.0, norm_type=math.inf)
    assert findings.known_entry(entries, no_empty_shard, failed) is None


def test_rediscovers_fsdp2_inf_norm_on_empty_shard():
    """Unaided (no manifest), seed 11, 40 examples: torch-fsdp2's first new failure is F9, shrunk to
    a configuration that still clips by the inf-norm with an empty shard. (Which seeds find it first
    depends on the drawn sequence, which hypothesis also ties to max_examples.)"""
    result = explore(load("torch-fsdp2"), seed=11, entries=[],
                     limits=Limits(max_examples=40, budget_s=300, shrink_examples=8, max_findings=1))
    assert result.findings, f"no finding in {result.examples} examples"
    first = result.findings[0]
    assert F9_ERROR in first.message, first.message[:2000]
    facts = first.config.facts()
    assert facts["norm_type"] == "inf" and facts["empty_shard"], to_json(first.config)
    print(f"\nrediscovered in {result.examples} examples, {result.seconds:.1f} s: {dumps(first.config)}")


def test_a_search_writes_nothing_into_the_working_folder(tmp_path):
    """hypothesis caches what it collects in ./.hypothesis unless told: a search keeps it out of the
    user's folder (a checkpoint check running beside it on another worker failed on the new folder)."""
    env = {k: v for k, v in os.environ.items() if k != "HYPOTHESIS_STORAGE_DIRECTORY"}
    code = ("from shardcheck.conformance.adapters import load\n"
            "from shardcheck.conformance.explore.search import Limits, explore\n"
            "explore(load('reference'), seed=0, entries=[],\n"
            "        limits=Limits(max_examples=2, budget_s=120, shrink_examples=1, max_findings=1))\n")
    (tmp_path / "search.py").write_text(code)
    (tmp_path / "work").mkdir()
    done = warm_python.run([str(tmp_path / "search.py")], cwd=tmp_path / "work", env=env, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "work").iterdir()) == []


def _explore_cli(*args: str, tmp_path: Path):
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    return warm_python.run(["-m", "shardcheck.conformance.cli", "explore", *args, "-o", str(tmp_path / "r.json")],
                           cwd=ROOT, env=env, timeout=600)


def test_explore_kills_a_mutant_the_fixed_matrix_misses(tmp_path):
    """mutant-hybrid-shard-size-squared is exact on the (2, 2) mesh, the fixed matrix's only
    HYBRID_SHARD mesh (every cell of `shardcheck run` passes), and wrong on every other: explore
    draws (1, 2) and (2, 1) meshes and finds it; the unmutated reference passes the same search."""
    args = ("--world-sizes", "2", "--examples", "12", "--shrink", "0", "--max-findings", "1", "--seed", "0")
    mutant = _explore_cli("--impl", "shardcheck.conformance.mutants:HybridShardSizeSquared", *args, tmp_path=tmp_path)
    assert mutant.returncode == 1, mutant.stdout + mutant.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    [run] = report["explore"]
    assert run["findings"] and "AssertionError" in run["findings"][0]["signature"], run
    assert run["findings"][0]["reproducer"].startswith("shardcheck explore --replay ")
    reference = _explore_cli("--impl", "reference", *args, tmp_path=tmp_path)
    assert reference.returncode == 0, reference.stdout + reference.stderr


def test_replay_runs_a_finding_file(tmp_path, capsys):
    """A finding file replays: F9's minimal configuration fails on torch-fsdp2 (exit 1), passes on
    the reference (exit 0)."""
    from shardcheck.conformance.cli.main import main

    config = Config(world_size=2, widths=(1, 1), bias=(False,), max_norm=1.0, norm_type=math.inf, steps=1)
    finding = findings.Finding("torch-fsdp2", 0, config, "RuntimeError: ...", "")
    path = tmp_path / "f9.json"
    path.write_text(json.dumps(findings.replay_document(finding)))
    assert main(["explore", "--replay", str(path)]) == 1
    assert F9_ERROR in capsys.readouterr().out
    assert main(["explore", "--replay", str(path), "--impl", "reference"]) == 0


MATRIX_KILLED = ("ClipLocalNorm", "ScalerFoundInfUnsynced", "GradNotAveraged", "ReduceInParamDtype",
                 "ScalerNoBackoff", "ScalerGrowthOffByOne", "HybridNoReplicaReduce")


@pytest.mark.skipif(os.environ.get("SHARDCHECK_EXPLORE_MUTANTS") != "1",
                    reason="slow: set SHARDCHECK_EXPLORE_MUTANTS=1")
@pytest.mark.parametrize("mutant", MATRIX_KILLED)
def test_explore_kills_behaviour_mutants(mutant, tmp_path):
    """Every behaviour-level mutant the fixed matrix kills, explore kills too (seed 0)."""
    run = _explore_cli("--impl", f"shardcheck.conformance.mutants:{mutant}", "--examples", "150", "--shrink", "0",
                       "--seed", "0", tmp_path=tmp_path)
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
