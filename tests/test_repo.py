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


def _ci_with_its_trap(tail: str) -> subprocess.CompletedProcess:
    """.ci/run's own prologue (up to its trap), then `tail`, run by bash as CI runs the script."""
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    trap = next(i for i, line in enumerate(lines) if line.startswith("trap "))
    prologue = [line for line in lines[:trap + 1] if not line.startswith("cd ")]
    return subprocess.run(["bash", "-c", "\n".join([*prologue, tail])], capture_output=True, text=True, timeout=60)


def test_ci_exits_with_its_last_commands_status_whether_or_not_the_lane_still_runs():
    """The EXIT trap ends the background lane's process group; when the lane had already finished,
    that kill fails, and under `set -e` it once made a green run exit 1 (CI, stop 65)."""
    finished = "set -m; ( true ) & LANE_PID=$!; set +m; sleep 0.5; "
    running = "set -m; ( sleep 60 ) & LANE_PID=$!; set +m; sleep 0.2; "
    for lane in (finished, running):
        assert _ci_with_its_trap(lane + "true").returncode == 0
        assert _ci_with_its_trap(lane + "false").returncode == 1
    proc = _ci_with_its_trap(running + "echo $LANE_PID")
    lane_pid = int(proc.stdout.split()[0])
    states = subprocess.run(["ps", "-o", "stat=", "-g", str(lane_pid)], capture_output=True, text=True).stdout
    assert all(state.startswith("Z") for state in states.split()), states  # ended (a zombie waits for init)
    assert "[.ci/run] ended at" in proc.stderr


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


def _plugin_state_on_configs(path: Path) -> list[str]:
    """Where a module keeps state on a pytest config: `config._shardcheck_*` read or written anywhere
    (`x.config._shardcheck_*` too); in a pytest plugin (a module defining `pytest_*` hooks) any private
    attribute set on a config (`config._x = ...`, `setattr(config, "_x", ...)`), or read through
    getattr / hasattr with a private name."""
    tree = ast.parse(path.read_text())
    plugin = any(isinstance(n, ast.FunctionDef) and n.name.startswith("pytest_") for n in ast.walk(tree))

    def is_config(node) -> bool:
        return (isinstance(node, ast.Name) and node.id == "config") or \
            (isinstance(node, ast.Attribute) and node.attr == "config")

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_config(node.value) and node.attr.startswith("_") \
                and not node.attr.startswith("__"):
            if node.attr.startswith("_shardcheck") or (plugin and isinstance(node.ctx, ast.Store)):
                found.append(f"{node.lineno}: config.{node.attr}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) >= 2
              and is_config(node.args[0]) and isinstance(node.args[1], ast.Constant)
              and str(node.args[1].value).startswith("_") and plugin):
            found.append(f"{node.lineno}: {node.func.id}(config, {node.args[1].value!r})")
    return found


def test_plugins_share_their_state_in_the_stash_not_on_the_config():
    """One SessionState under a StashKey (shardcheck/session_state.py) holds what the plugins share:
    no module keeps private attributes on a pytest config."""
    kept = {p.relative_to(ROOT).as_posix(): found
            for p in (ROOT / "shardcheck").rglob("*.py")
            if (found := _plugin_state_on_configs(p))}
    assert not kept


def test_the_rule_on_config_state_sees_each_way_of_keeping_it(tmp_path):
    """The check above is not blind: each shape it forbids, written into a module, is found."""
    shapes = {"config._shardcheck_x = 1": True, "y = item.config._shardcheck_x": True,
              "config._mine = 1": True, "setattr(config, '_mine', 1)": True,
              "hasattr(session.config, '_mine')": True,
              "config.stash[KEY] = 1": False, "y = config._parser": False}
    for line, forbidden in shapes.items():
        module = tmp_path / "plugin_like.py"
        module.write_text(f"def pytest_configure(config):\n    {line}\n")
        assert bool(_plugin_state_on_configs(module)) is forbidden, line


REPORT = ROOT / "shardcheck" / "conformance" / "report"
PLUGIN_LAYER = ("shardcheck.conformance.plugins", "shardcheck.harness.plugin", "shardcheck.pytest_plugin")


def _imports_of(path: Path) -> set[str]:
    """Every module a file imports (at its top or inside a function), `from a import b` as `a.b` too."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def test_the_report_layer_imports_no_plugin_or_selection_module():
    """The report writer is handed what the plugins decided (shardcheck/session_state.py): nothing
    under shardcheck/conformance/report/ reaches up into the pytest plugins (selection, harness, entry point)."""
    up = {p.relative_to(ROOT).as_posix(): sorted(m for m in _imports_of(p)
                                                 if any(m == u or m.startswith(u + ".") for u in PLUGIN_LAYER))
          for p in REPORT.rglob("*.py")}
    assert not {path: modules for path, modules in up.items() if modules}
    assert "shardcheck.session_state.of" in _imports_of(REPORT / "writer.py")  # where it reads them instead


def test_every_torch_lower_bound_the_repository_states_is_pyprojects():
    """tox.ini, the docs and the package's texts say the one `torch>=` pyproject.toml declares."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = next(re.match(r"torch>=([^,;\s]+)", r).group(1) for r in project["dependencies"] if r.startswith("torch"))
    texts = [ROOT / "tox.ini", ROOT / "README.md", ROOT / "ARCHITECTURE.md", *(ROOT / "docs").rglob("*.md"),
             *(ROOT / "shardcheck").rglob("*.py")]
    stated = {(p.relative_to(ROOT).as_posix(), bound) for p in texts
              for bound in re.findall(r"torch\s*>=\s*([0-9][0-9.]*[0-9])", p.read_text())}
    assert ("tox.ini", declared) in stated  # the texts the rule exists for say it
    assert ("docs/development.md", declared) in stated
    assert {(path, bound) for path, bound in stated if bound != declared} == set()


def test_the_impl_option_names_every_builtin_adapter():
    """`--shardcheck-impl`'s help is made from the adapters' one list (shardcheck/builtin_adapters.py)."""
    from shardcheck.builtin_adapters import BUILTIN
    from shardcheck.conformance import adapters

    assert adapters.BUILTIN is BUILTIN
    proc = subprocess.run([sys.executable, "-m", "pytest", "--help", "-p", "no:cacheprovider"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    helped = re.search(r"--shardcheck-impl=SHARDCHECK_IMPL\s+(.*?)\n\s+--", proc.stdout, re.S)
    assert helped, proc.stdout[-2000:]
    text = " ".join(helped.group(1).split())
    assert f"a built-in name ({', '.join(BUILTIN)})" in text, text


def test_the_schema_version_is_written_once():
    """The version the writer writes is schema.json's own const; the architecture page says the same."""
    import json

    from shardcheck.conformance.report import reading, writer

    schema = json.loads((REPORT / "schema.json").read_text())
    assert reading.SCHEMA_VERSION == writer.SCHEMA_VERSION == schema["properties"]["schema_version"]["const"]
    assert schema["$id"].endswith(f"/v{reading.SCHEMA_VERSION}.json")
    assert set(reading.SCHEMAS) == set(range(2, reading.SCHEMA_VERSION + 1))
    said = re.findall(r"`schema.json` \(version (\d+)", (ROOT / "ARCHITECTURE.md").read_text())
    assert said == [str(reading.SCHEMA_VERSION)], said
    for path in (REPORT / "writer.py", REPORT / "reading.py"):  # no text there claims a number of its own
        assert not re.search(r"is schema version \d|The version \d report|^SCHEMA_VERSION = \d", path.read_text(), re.M), path
