"""The repository's promises about itself."""

import ast
import configparser
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands():
    block = re.search(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    return [line for line in block.splitlines() if line and not line.startswith("#")]


def test_ci_runs_the_readme_test_command():
    install_and_run, test_command = _readme_commands()
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert ci_lines[-1] == test_command
    assert "pip install torch==2.13.0" in install_and_run and "shardcheck run" in install_and_run
    assert any("pip install" in line and "torch==2.13.0" in line for line in ci_lines)


def test_ci_builds_fresh_ignored_virtualenvs_and_installs_torch_first():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python -m venv" in ci and "--system-site-packages" not in ci
    assert ".venv-ci/" in (ROOT / ".gitignore").read_text().splitlines()
    lines = ci.splitlines()
    install_readme = next(i for i, line in enumerate(lines) if line.startswith("install_readme() {"))
    torch_first = lines.index("  pip install torch==2.13.0", install_readme)
    assert install_readme < torch_first < lines.index("  pip install -e '.[test]'", install_readme)
    assert lines.index("}", install_readme) == torch_first + 2  # nothing else installed
    readme_step = lines.index("ready_venv readme")
    lowest = next(i for i, line in enumerate(lines) if "-c .ci/lowest-constraints.txt" in line)
    assert lowest < readme_step  # the lowest-versions step comes before the README's test command


def _lower_bounds_in_pyproject() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] + project["optional-dependencies"]["test"]
    bounds = dict(re.match(r"([A-Za-z0-9_.-]+)>=([^,;\s]+)", r).groups() for r in requirements)
    bounds.pop("torch")  # pinned to the CPU build everywhere
    return {name: Version(v) for name, v in bounds.items()}


def _pins(path: Path) -> dict[str, str]:
    lines = [line.strip() for line in path.read_text().splitlines()]
    pins = dict(line.split("==") for line in lines if line and not line.startswith("#"))
    return {name: Version(v) for name, v in pins.items()}


def test_lowest_constraints_are_pyprojects_lower_bounds():
    assert _pins(ROOT / ".ci" / "lowest-constraints.txt") == _lower_bounds_in_pyproject()
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(ROOT / "tox.ini")
    assert "-r{toxinidir}/.ci/lowest-constraints.txt" in tox["testenv:lowest"]["deps"]


def test_every_tox_environment_installs_its_own_pinned_torch_first():
    """No environment reads a torch from outside itself (sitepackages), torch is the first thing
    installed, and shardcheck's install is held to what is installed (a range never pulls a torch)."""
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(ROOT / "tox.ini")
    base = tox["testenv"]
    deps = [line.strip() for line in base["deps"].strip().splitlines()]
    assert deps[0].startswith("--extra-index-url {env:SHARDCHECK_TORCH_INDEX:")
    assert deps[1] == "{env:SHARDCHECK_TORCH:torch==2.13.0}"
    assert base["constrain_package_deps"].strip() == base["use_frozen_constraints"].strip() == "true"
    for name in tox.sections():
        env = tox[name]
        assert env.get("sitepackages", "false").strip() == "false", name
        assert env.get("skip_install", "false").strip() == "false", name
        if name.startswith("testenv:") and "deps" in env:
            assert env["deps"].strip().startswith("{[testenv]deps}"), name


def test_only_one_module_imports_torch_testing_internal():
    users = [p.relative_to(ROOT).as_posix()
             for folder in ("shardcheck",)
             for p in (ROOT / folder).rglob("*.py")
             if "torch.testing._internal" in p.read_text()]
    assert users == ["shardcheck/harness/threads.py"]


def test_no_module_over_400_lines():
    long = {p.relative_to(ROOT).as_posix(): n
            for folder in ("shardcheck",)
            for p in (ROOT / folder).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 400}
    assert not long


def _private_uses_of_other_modules(path: Path) -> list[str]:
    """`from ours import _x`, a module path through `_private`, or `module._x` on a module of ours."""
    ours = ("shardcheck", "tests")
    found, modules = [], set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] in ours):
            parts = (node.module or "").split(".")
            for alias in node.names:
                if alias.name.startswith("_") or any(p.startswith("_") for p in parts):
                    found.append(f"{node.lineno}: from {node.module} import {alias.name}")
                base = ROOT.joinpath(*parts, alias.name) if not node.level else None
                if base is not None and (base.with_suffix(".py").is_file() or base.is_dir()):
                    modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] in ours:
                    modules.add(alias.asname or parts[0])
                    if any(p.startswith("_") for p in parts):
                        found.append(f"{node.lineno}: import {alias.name}")
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            found.append(f"{node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_no_private_name_is_used_across_modules():
    """One home per idea, used by its public name: nothing imports (or reaches into) another module's
    `_private` names or `_private` modules."""
    uses = {p.relative_to(ROOT).as_posix(): found
            for folder in ("shardcheck", "tests")
            for p in (ROOT / folder).rglob("*.py")
            if (found := _private_uses_of_other_modules(p))}
    assert not uses


def test_pytest_as_a_console_script_finds_the_packages_not_the_test_folders():
    """`pytest` (not `python -m pytest`) does not put the checkout on sys.path, and pytest puts tests/
    there: tests/reference_impl/ was then imported as the package reference_impl (a namespace one),
    before an editable install's finder was asked, and no implementation could load."""
    script = Path(sys.executable).parent / "pytest"  # a fresh process: a warm one inherits sys.path
    proc = subprocess.run([str(script), "--co", "-q", "tests/test_repo.py",  # tests/ goes on sys.path
                           "shardcheck/conformance/checks/api/test_comm_hooks.py", "-k",
                           "default_communication_hook_behavior and ws2"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert re.search(r"\b3/\d+ tests collected", proc.stdout), proc.stdout[-2000:]  # the three cells
