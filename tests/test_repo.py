"""The repository's promises about itself."""

import re
from pathlib import Path

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


def test_only_one_module_imports_torch_testing_internal():
    users = [p.relative_to(ROOT).as_posix()
             for folder in ("harness", "conformance", "reference_impl")
             for p in (ROOT / folder).rglob("*.py")
             if "torch.testing._internal" in p.read_text()]
    assert users == ["harness/threads.py"]


def test_no_module_over_400_lines():
    long = {p.relative_to(ROOT).as_posix(): n
            for folder in ("harness", "conformance", "reference_impl")
            for p in (ROOT / folder).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 400}
    assert not long
