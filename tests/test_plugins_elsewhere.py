"""shardcheck's one pytest entry point loads into every pytest session of an environment where it is
installed (pytest11: shardcheck): in another project's session that uses none of it, it imports
nothing beyond itself (no torch, no hypothesis, no jsonschema, no other plugin of ours), prints
nothing, takes none of the project's option names or package names, and `-p no:shardcheck` turns it
off whole. A session that does use it (an option, a `@distributed` test) gets the harness."""

from __future__ import annotations

import json
import subprocess
import sys

PROJECT_TEST = "def test_one():\n    assert 1 + 1 == 2\n"
# The project's own option names, which shardcheck once took: they must stay free.
PROJECT_CONFTEST = '''
import json, sys

def pytest_addoption(parser):
    for name in ("--backend", "--launch", "--impl", "--world-sizes", "--rank-timeout"):
        parser.addoption(name, default=None)

def pytest_sessionfinish(session):
    with open("modules.json", "w") as f:
        json.dump(sorted(m for m in sys.modules
                         if m.split(".")[0] in ("torch", "shardcheck", "hypothesis", "jsonschema", "rich")), f)
'''
# What the entry point may import in a session that does not use shardcheck: itself, the built-in
# adapters' names its help lists (data alone), and where pytest-xdist is installed, the small module
# that teaches `-n` the word `gpus` (with what it names).
ENTRY = {"shardcheck", "shardcheck.pytest_plugin", "shardcheck.builtin_adapters"}
GPUS_WORD = {"shardcheck.harness", "shardcheck.harness.xdist_support", "shardcheck.harness.devices",
             "shardcheck.harness.vocabulary", "shardcheck.errors"}  # errors: LeaseTimeout's base (it imports nothing)


def _project_session(tmp_path, *args: str, test: str = PROJECT_TEST) -> tuple[subprocess.CompletedProcess, list[str]]:
    """A fresh interpreter (no torch preloaded), running another project's one test."""
    (tmp_path / "test_project.py").write_text(test)
    (tmp_path / "conftest.py").write_text(PROJECT_CONFTEST)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:hypothesispytest",
                           *args], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    modules = tmp_path / "modules.json"
    return proc, json.loads(modules.read_text()) if modules.exists() else []


def test_an_unrelated_session_imports_nothing_beyond_the_entry_point_and_prints_nothing(tmp_path):
    proc, modules = _project_session(tmp_path, "--backend", "theirs")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert set(modules) <= ENTRY | GPUS_WORD, sorted(set(modules) - ENTRY - GPUS_WORD)
    ours = [line for line in proc.stdout.splitlines() if "shardcheck" in line and not line.startswith("plugins:")]
    assert not ours, ours  # (pytest's own "plugins:" line lists every installed plugin)


def test_switched_off_it_imports_nothing_at_all(tmp_path):
    proc, modules = _project_session(tmp_path, "-p", "no:shardcheck")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "INTERNALERROR" not in proc.stdout + proc.stderr
    assert modules == [], modules


def test_a_project_with_its_own_harness_and_conformance_packages_is_not_shadowed(tmp_path):
    for name in ("harness", "conformance", "reference_impl"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"OWNER = 'the project: {name}'\n")
    test = ("from harness import OWNER as H\nfrom conformance import OWNER as C\n"
            "from reference_impl import OWNER as R\n\n"
            "def test_own_packages():\n    assert (H, C, R) == ('the project: harness', 'the project: conformance', "
            "'the project: reference_impl')\n")
    proc, _ = _project_session(tmp_path, "-q", test=test)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 passed" in proc.stdout


def test_a_distributed_test_needs_no_option_to_get_the_harness(tmp_path):
    test = ("import torch, torch.distributed as dist\nfrom shardcheck.harness import distributed\n\n"
            "@distributed(world_size=2, backend='threaded')\ndef test_sum(ctx):\n"
            "    t = torch.ones(1) * ctx.rank\n    dist.all_reduce(t)\n    assert t.item() == 1\n")
    proc, _ = _project_session(tmp_path, "-q", test=test)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 passed" in proc.stdout


def test_hypothesis_is_an_extra_not_a_dependency():
    """hypothesis's own pytest plugin would load in every session of a user's environment."""
    from importlib.metadata import requires

    hypothesis = [r for r in requires("shardcheck") if r.startswith("hypothesis")]
    assert hypothesis and all("extra ==" in r for r in hypothesis), hypothesis


def test_explore_without_hypothesis_is_one_line(monkeypatch, capsys):
    from shardcheck.conformance import explore
    from shardcheck.conformance.cli.main import main

    monkeypatch.setattr(explore, "available", lambda: False)
    assert main(["explore", "--impl", "reference"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"shardcheck explore: {explore.MISSING}", err
