"""The seed map (shardcheck/conformance/checks/seed_map.toml) is complete and points at checks that exist.

* every seed case has exactly one entry: the number of cases per seed and per test method (one case
  = one test method x one element of its parametrization, inner subtest loops included) is fixed
  below from reading the seeds, and where the seed files are present (SHARDCHECK_SEEDS, default
  /work/shared/seeds) their `def test_*` methods are cross-checked against the map;
* every entry's check patterns (and behaviour patterns) match at least one collected cell
  (``pytest --collect-only`` over shardcheck/conformance/checks, impl id removed; `*` is the only wildcard);
* classes are from the vocabulary, every non-faithful entry says why;
* ``python -m pytest tests/conformance/test_seed_map.py -s`` prints the counts per class per seed
  (the table in docs/conformance.md).
"""

from __future__ import annotations

import os
import re
import tomllib
from collections import Counter
from pathlib import Path

import pytest

import warm_python

ROOT = Path(__file__).resolve().parents[2]
CHECKS = ROOT / "shardcheck" / "conformance" / "checks"
SEED_MAP = CHECKS / "seed_map.toml"
SEEDS_DIR = Path(os.environ.get("SHARDCHECK_SEEDS", "/work/shared/seeds"))
CLASSES = ("faithful", "deviation", "weaker", "missing")

# Cases per seed method, read off the seeds (parametrize x run_subtests x inner loops).
METHOD_CASES = {
    "000": {"TestClipGradNormWorldSize2.test_clip_grad_norm_1d": 3,          # norm 2, 1, inf
            "TestClipGradNormWorldSize4.test_clip_grad_norm_2d": 4},         # norm 2, 1, 3, inf
    "001": {"TestShardGradScaler.test_grad_scaling": 1,
            "TestShardGradScaler.test_scaling_unscaling_sparse": 1,
            "TestShardGradScaler.test_inf_gradients_skip_optim_step": 1,
            # 16 configs x CUDAInitMode (AFTER, BEFORE; + NEVER with offload): 8 x 3 + 8 x 2
            "TestShardedGradScalerParityWithDDP.test_fsdp_ddp_parity_with_grad_scaler": 40,
            "TestShardedGradScalerParityWithDDP.test_sharded_grad_scaler_found_inf": 4},
    "002": {"TestFullyShardAllGatherExtensionsMultiProcess.test_all_gather_extensions_train_parity": 2,
            "TestFullyShardAllGatherExtensionsMultiThread.test_all_gather_extensions_end_to_end": 2,
            "TestFullyShardAllGatherExtensionsMultiThread.test_all_gather_extensions_monkey_patch": 1},
    "003": {"TestClipGradNorm.test_non_root": 1,
            "TestClipGradNorm.test_ddp_parity": 72,                          # 2 x 3 x 3 x 2 x 2
            "TestClipGradNorm.test_low_precision_grads": 24,                 # 2 x 3 x 2 x 2
            "TestClipGradNorm.test_no_gradients": 2},
    "004": {"TestCommunicationHooks.test_default_communication_hook_behavior": 3,
            "TestCommunicationHooks.test_default_communication_hook_initialization": 6,
            "TestCommunicationHooks.test_registering_hook_non_root": 3,
            "TestCommunicationHooks.test_registering_hook_submodules": 3,
            "TestCommunicationHooks.test_fp16_hook": 6,
            "TestCommunicationHooks.test_bf16_hook": 6},
}
# Methods whose `def` line the seed FILE lost (the seed copies are machine-translated and damaged);
# the body is still there, identified by a phrase of its docstring.
LOST_DEF_LINES = {
    ("004", "test_registering_hook_submodules"): "Checks behavior if a hook was registered for a non-root submodule",
}
SEED_CASES = {seed: sum(m.values()) for seed, m in METHOD_CASES.items()}  # 7, 47, 5, 99, 27 = 185


def _entries() -> list[dict]:
    return tomllib.loads(SEED_MAP.read_text())["case"]


def test_every_seed_case_has_one_entry():
    entries = _entries()
    keys = [(e["seed"], e["method"], e["params"]) for e in entries]
    dup = [k for k, n in Counter(keys).items() if n > 1]
    assert not dup, f"seed cases mapped twice: {dup}"
    per_method = Counter((e["seed"], e["method"]) for e in entries)
    expected = {(s, m): n for s, ms in METHOD_CASES.items() for m, n in ms.items()}
    assert dict(per_method) == expected, (
        "seed cases missing or extra in the seed map:\n  " +
        "\n  ".join(f"{k}: map {per_method.get(k, 0)}, seed {expected.get(k, 0)}"
                    for k in sorted(set(per_method) | set(expected)) if per_method.get(k) != expected.get(k)))
    assert sum(SEED_CASES.values()) == len(entries) == 185


@pytest.mark.skipif(not SEEDS_DIR.is_dir(), reason=f"seed files not present ({SEEDS_DIR})")
def test_seed_methods_match_the_seed_files():
    """Every `def test_*` of a seed file is in METHOD_CASES and vice versa (the seeds are markdown-
    wrapped, partly broken Python, so methods are found by pattern, not ast)."""
    for seed, methods in METHOD_CASES.items():
        (path,) = SEEDS_DIR.glob(f"{seed}_*.txt")
        text = path.read_text()
        found = set(re.findall(r"^\s*def (test_\w+)\(", text, re.MULTILINE))
        for (s, method), phrase in LOST_DEF_LINES.items():
            if s == seed and method not in found:
                assert phrase in text, f"{seed}: neither the def of {method} nor its docstring found"
                found.add(method)
        assert found == {m.rpartition(".")[2] for m in methods}, (seed, found)


def test_entries_are_well_formed():
    for e in _entries():
        where = f"{e['seed']} {e['method']} [{e['params']}]"
        assert e["class"] in CLASSES, f"{where}: class {e['class']!r}"
        assert e["checks"] or e["class"] == "missing", f"{where}: no check named"
        assert e["class"] == "faithful" or e.get("reason"), f"{where}: a {e['class']} case needs a reason"
        assert e.get("runs_on") in (None, "accelerator"), where


@pytest.fixture(scope="module")
def collected() -> list[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("SHARDCHECK_IMPL", "PYTEST_ADDOPTS")}
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    proc = warm_python.run(
        ["-m", "pytest", str(CHECKS.relative_to(ROOT)), "--collect-only", "-q", "--shardcheck-impl", "reference",
         "-o", "addopts=", "-p", "no:cacheprovider", "-p", "shardcheck.pytest_plugin"],
        cwd=ROOT, env=env, timeout=300)
    prefix = str(CHECKS.relative_to(ROOT)) + "/"
    ids = [line.removeprefix(prefix).replace("[reference-", "[").replace("[reference]", "")
           for line in proc.stdout.splitlines() if line.startswith(prefix) and "::" in line]
    assert ids, f"nothing collected:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return ids


def _matches(pattern: str, ids: list[str]) -> bool:
    """`*` is the only wildcard (brackets are literal: node ids are full of them)."""
    rx = re.compile("^" + ".*".join(re.escape(part) for part in pattern.split("*")) + "$")
    return any(rx.match(i) for i in ids)


def test_every_pattern_names_existing_cells(collected):
    dead = []
    for e in _entries():
        for pattern in e["checks"] + e.get("behaviour", []):
            if not _matches(pattern, collected):
                dead.append(f"{e['seed']} {e['method']} [{e['params']}]: {pattern}")
    assert not dead, "seed-map patterns that match no collected check cell:\n  " + "\n  ".join(dead)


def test_counts_per_class(capsys):
    """Prints the table in docs/conformance.md: cases per class per seed."""
    counts = Counter((e["seed"], e["class"]) for e in _entries())
    accel = Counter(e["seed"] for e in _entries() if e.get("runs_on") == "accelerator")
    findings = Counter(e["seed"] for e in _entries() if e.get("finding"))
    rows = ["| seed | cases | " + " | ".join(CLASSES) + " | accelerator-only | seed findings |",
            "|---|---|" + "---|" * (len(CLASSES) + 2)]
    for seed in sorted(SEED_CASES):
        rows.append(f"| {seed} | {SEED_CASES[seed]} | " + " | ".join(str(counts[(seed, c)]) for c in CLASSES) +
                    f" | {accel[seed]} | {findings[seed]} |")
    rows.append(f"| all | {sum(SEED_CASES.values())} | " + " | ".join(str(sum(counts[(s, c)] for s in SEED_CASES))
                                                                   for c in CLASSES) +
                f" | {sum(accel.values())} | {sum(findings.values())} |")
    with capsys.disabled():
        print("\n" + "\n".join(rows))
    assert sum(counts.values()) == sum(SEED_CASES.values())
