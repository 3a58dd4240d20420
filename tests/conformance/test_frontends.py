"""The front-end adapters (shardcheck/conformance/adapters/accelerate.py, lightning.py): without their extras the
registry leaves them out with the install command; with them, the documented setups pass a few cells,
and the setups FINDINGS F27-F30 describe fail them (strict xfails: a fix would fail the run), and a
user's own Accelerate config file is judged on the cells it matches, the others unsupported."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import pytest

import warm_python
from shardcheck.conformance.adapters import every_builtin

ROOT = Path(__file__).resolve().parents[2]
EXTRAS = {"accelerate": "accelerate", "lightning": "lightning"}
CELLS = "test_train_parity and uneven_mlp and (FULL_SHARD or SHARD_GRAD_OP) and (noclip or norm2)"


def _needs(module: str):
    return pytest.mark.skipif(importlib.util.find_spec(module) is None,
                              reason=f"{module} is not installed: pip install -e '.[{module}]' (its CI step runs these)")


def _cells(impl: str, *, env=None, k: str = CELLS):
    return warm_python.run(["-m", "pytest", "shardcheck/conformance/checks/behaviour/test_train_parity.py", "--shardcheck-impl", impl,
                            "--shardcheck-world-sizes", "2", "-q", "-rxs", "-o", "addopts=", "-p", "no:cacheprovider", "-k", k],
                           cwd=ROOT, timeout=600, env=env)


@pytest.mark.parametrize("name", sorted(EXTRAS))
def test_registry_lists_the_front_end_or_says_how_to_install_it(name):
    names, left_out = every_builtin()
    if importlib.util.find_spec(EXTRAS[name]) is None:
        assert f"pip install -e '.[{name}]'" in left_out[name], left_out.get(name)
    else:
        assert name in names and f"{name}[unshimmed]" in names, names


@pytest.mark.parametrize("target,outcome", [
    pytest.param("accelerate", "4 passed", marks=_needs("accelerate")),
    pytest.param("accelerate[fsdp2]", "4 passed", marks=_needs("accelerate")),
    pytest.param("accelerate[joint]", "4 xfailed", marks=_needs("accelerate")),       # F28
    pytest.param("accelerate[unshimmed]", "4 xfailed", marks=_needs("accelerate")),   # F27
    pytest.param("lightning", "4 passed", marks=_needs("lightning")),
    pytest.param("lightning[model-parallel]", "4 passed", marks=_needs("lightning")),
    pytest.param("lightning[model-parallel-joint]", "4 xfailed", marks=_needs("lightning")),  # F29
    pytest.param("lightning[unshimmed]", "4 xfailed", marks=_needs("lightning")),     # F30
])
def test_documented_setups_pass_and_the_findings_fail(target, outcome):
    proc = _cells(target)
    assert proc.returncode == 0 and outcome in proc.stdout and not re.search(r"\d+ failed", proc.stdout), \
        proc.stdout[-3000:]


@_needs("accelerate")
def test_a_users_accelerate_config_is_judged_on_the_cells_it_matches(tmp_path):
    config = tmp_path / "my_config.yaml"
    config.write_text("distributed_type: FSDP\nmixed_precision: 'no'\nfsdp_config:\n  fsdp_version: 2\n"
                      "  fsdp_reshard_after_forward: false\n")
    env = {**os.environ, "SHARDCHECK_ACCELERATE_CONFIG": str(config)}
    proc = _cells("accelerate[config]", env=env)
    assert proc.returncode == 0 and "2 passed, " in proc.stdout and "2 unsupported" in proc.stdout, proc.stdout[-3000:]
    config.write_text("mixed_precision: 'no'\nfsdp_config:\n  fsdp_sharding_strategy: FULL_SHARD\n  fsdp_typo: 1\n")
    proc = _cells("accelerate[config]", env=env, k="test_train_parity and uneven_mlp and FULL_SHARD and noclip")
    assert proc.returncode == 1 and "fsdp_config keys typo are not FullyShardedDataParallelPlugin fields" in proc.stdout, \
        proc.stdout[-3000:]
