"""shardcheck's pytest plugins load into every pytest session of an environment where it is installed
(entry points pytest11): in another project's session that uses none of it they cost nothing
measurable (no torch, no adapter, no header line), their options never clash with the project's own,
and each can be switched off alone."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PLUGINS = ("shardcheck", "shardcheck-conformance", "shardcheck-report")
PROJECT_TEST = "def test_one():\n    assert 1 + 1 == 2\n"
# The project's own option names, which shardcheck once took: they must stay free.
PROJECT_CONFTEST = '''
import json, sys

def pytest_addoption(parser):
    for name in ("--backend", "--launch", "--impl", "--world-sizes", "--rank-timeout"):
        parser.addoption(name, default=None)

def pytest_sessionfinish(session):
    with open("modules.json", "w") as f:
        json.dump(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "conformance", "harness")), f)
'''


def _project_session(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """A fresh interpreter (no torch preloaded), running another project's one test."""
    (tmp_path / "test_project.py").write_text(PROJECT_TEST)
    (tmp_path / "conftest.py").write_text(PROJECT_CONFTEST)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    modules = tmp_path / "modules.json"
    return proc, json.loads(modules.read_text()) if modules.exists() else []


def test_an_unrelated_session_imports_no_torch_and_prints_nothing_of_ours(tmp_path):
    proc, modules = _project_session(tmp_path, "--backend", "theirs")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not [m for m in modules if m.split(".")[0] == "torch"], modules
    assert not [m for m in modules if m.startswith(("conformance.adapters", "harness.runner", "harness.pool"))]
    ours = [line for line in proc.stdout.splitlines() if "shardcheck" in line and not line.startswith("plugins:")]
    assert not ours, ours  # (pytest's own "plugins:" line lists every installed plugin)


@pytest.mark.parametrize("plugin", PLUGINS)
def test_each_plugin_can_be_switched_off_alone(tmp_path, plugin):
    proc, _ = _project_session(tmp_path, "-p", f"no:{plugin}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "INTERNALERROR" not in proc.stdout + proc.stderr
