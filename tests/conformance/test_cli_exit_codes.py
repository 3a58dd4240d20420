"""The same kind of bad input ends every `shardcheck` command with the same exit status
(cli/exit_codes.py), in one line on stderr, before anything runs: an output path that cannot be
written, an unknown implementation, an adapter that cannot be built, a file that is not what it
should be. In-process calls of cli.main, none of which starts a rank or a pytest session. And the
command line's shape: one module per subcommand, no bare status, one family of errors."""

from __future__ import annotations

import ast
import builtins
import json
import os
import sys
from pathlib import Path

import pytest

from shardcheck.conformance.cli import exit_codes as codes
from shardcheck.conformance.cli import main as cli
from shardcheck.errors import ShardcheckError

ROOT = Path(__file__).resolve().parents[2]
ONE_CELL = ["--family", "comm_hooks", "--world-sizes", "2", "-k", "default_communication_hook_behavior and NO_SHARD"]
SIMULATE = ["--world-size", "8", "--model", "tiny"]

# {kind of bad input: [(command line, a phrase of its one line)]}; `afile` is a file where a folder
# should be, `garbage.json` a file that is no report, stream or finding, `broken:Adapter` a module
# that raises when imported.
CASES = {
    codes.UNWRITABLE: [
        (["run", *ONE_CELL, "-o", "afile/r.json"], "not a directory"),
        (["simulate", *SIMULATE, "-o", "afile/s.json"], "not a directory"),
        (["explore", "-o", "afile/e.json"], "not a directory"),
        (["report", "assemble", "garbage.json", "-o", "afile/r.json"], "not a directory"),
        (["report", "upgrade", "garbage.json", "-o", "afile/r.json"], "not a directory"),
        (["report", "merge", "garbage.json", "-o", "afile/r.json"], "not a directory"),
        (["matrix", "garbage.json", "--markdown", "afile/m.md"], "not a directory"),
        (["matrix", "garbage.json", "--html", "afile/m.html"], "not a directory"),
        (["releases", "torch==2.9.1", "-o", "afile"], "not a directory"),
    ],
    codes.UNKNOWN_NAME: [
        (["run", "--impl", "nope"], "unknown implementation 'nope'"),
        (["run", "--impl", "reference,nope"], "unknown implementation 'nope'"),
        (["run", "--family", "nope"], "unknown family nope"),
        (["simulate", *SIMULATE, "--impl", "nope"], "unknown implementation 'nope'"),
        (["simulate", "--world-size", "8", "--model", "nope"], "unknown model preset 'nope'"),
        (["explore", "--impl", "nope"], "unknown implementation 'nope'"),
        (["cells", "--impl", "nope"], "unknown implementation 'nope'"),
        (["cells", "--impl", "reference", "--family", "nope"], "unknown family nope"),
    ],
    codes.ADAPTER_IMPORT: [
        (["run", "--impl", "broken:Adapter"], "raised ValueError: no engine here"),
        (["simulate", *SIMULATE, "--impl", "broken:Adapter"], "raised ValueError: no engine here"),
        (["explore", "--impl", "broken:Adapter"], "raised ValueError: no engine here"),
        (["cells", "--impl", "broken:Adapter"], "raised ValueError: no engine here"),
    ],
    codes.USAGE: [
        (["run", *ONE_CELL, "--split", "1/2", "--durations", "garbage.json"], "garbage.json"),
        (["report", "assemble", "garbage.json"], "not a shardcheck stream"),
        (["report", "upgrade", "garbage.json"], "garbage.json"),
        (["report", "merge", "garbage.json", "-o", "m.json"], "garbage.json"),
        (["matrix", "garbage.json"], "garbage.json"),
        (["diff", "garbage.json", "garbage.json"], "garbage.json"),
        (["explore", "--replay", "garbage.json"], "garbage.json"),
        (["explore", "--world-sizes", "0"], "--world-sizes '0'"),
        (["simulate", *SIMULATE, "--rank", "8"], "rank 8 is outside world size 8"),
        (["releases", "torch>=2.9"], "expected PACKAGE==V1"),
    ],
}


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """A project folder holding the bad inputs, as the working folder; the import path and PYTHONPATH
    the commands extend with it restored afterwards."""
    (tmp_path / "afile").write_text("")
    (tmp_path / "garbage.json").write_text("{not json\n")
    (tmp_path / "broken.py").write_text("raise ValueError('no engine here')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    return tmp_path


@pytest.mark.parametrize("code, argv, phrase", [(code, argv, phrase) for code, cases in CASES.items()
                                                for argv, phrase in cases],
                         ids=[f"{code}-{' '.join(argv[:3])}" for code, cases in CASES.items() for argv, _ in cases])
def test_the_same_bad_input_is_the_same_status_in_every_command(folder, capsys, code, argv, phrase):
    before = sorted(p.name for p in folder.rglob("*"))
    assert cli.main(argv) == code
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and phrase in lines[0] and lines[0].startswith("shardcheck"), captured.err
    assert "Traceback" not in captured.err and "report written" not in captured.out
    assert sorted(p.name for p in folder.rglob("*") if "__pycache__" not in str(p)) == before  # nothing left


def test_every_command_is_covered_and_every_status_is_its_own():
    assert {argv[0] for cases in CASES.values() for argv, _ in cases} == set(cli.COMMANDS)
    named = {k: v for k, v in vars(codes).items() if k.isupper()}
    assert len(set(named.values())) == len(named) == 9, named  # no two classes share a status


def test_every_subcommand_is_one_module_with_add_parser_and_main():
    for name, module in cli.COMMANDS.items():
        assert callable(module.add_parser) and callable(module.main), name
        assert Path(module.__file__).parent == Path(cli.__file__).parent, name


NOT_STATUSES = {"workers_for"}  # functions of the command modules that return a number that is no status


def _bare_statuses(path: Path) -> list[str]:
    """`return 2`, `return 1 if x else 0`, `sys.exit(3)`, `self.exit(2, ...)`: a status as a number."""
    found = []
    tree = ast.parse(path.read_text())
    for function in [f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name in NOT_STATUSES]:
        function.body = []
    for node in ast.walk(tree):
        value = None
        if isinstance(node, ast.Return):
            value = node.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "exit" \
                and node.args:
            value = node.args[0]
        parts = [value.body, value.orelse] if isinstance(value, ast.IfExp) else [value]
        found += [f"{path.name}:{node.lineno}" for v in parts
                  if isinstance(v, ast.Constant) and type(v.value) is int]
    return found


def test_no_command_returns_a_bare_status():
    commands = [p for p in (ROOT / "shardcheck" / "conformance" / "cli").glob("*.py") if p.name != "exit_codes.py"]
    assert [f for p in commands for f in _bare_statuses(p)] == []


def test_the_walker_finds_bare_statuses(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f(x):\n    if x:\n        return 2\n    return 1 if x else 0\n\ndef g(self):\n    self.exit(2, 'x')\n")
    assert sorted(_bare_statuses(bad)) == ["bad.py:3", "bad.py:4", "bad.py:4", "bad.py:7"]  # both arms of line 4


def _exception_classes() -> dict[str, tuple[str, list[str]]]:
    """{class name: (module file, base names)} of every class in the package that is an exception
    (derives from a builtin exception, directly or through another class of the package)."""
    classes: dict[str, tuple[str, list[str]]] = {}
    for path in (ROOT / "shardcheck").rglob("*.py"):
        if "repros" in path.parts:  # standalone reproductions: the engine alone, no shardcheck
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = [b.id if isinstance(b, ast.Name) else b.attr for b in node.bases
                         if isinstance(b, ast.Name | ast.Attribute)]
                classes[node.name] = (path.relative_to(ROOT).as_posix(), bases)

    def is_exception(name: str, seen=()) -> bool:
        if name in seen:
            return False
        builtin = getattr(builtins, name, None)
        if isinstance(builtin, type) and issubclass(builtin, BaseException):
            return True
        return name in classes and any(is_exception(b, (*seen, name)) for b in classes[name][1])

    return {name: entry for name, entry in classes.items() if is_exception(name)}


def test_every_error_of_the_package_is_a_shardcheck_error():
    """One family: every exception class shardcheck defines derives from ShardcheckError (whose
    exit_status the command line ends with), so the command line catches the base once."""
    def in_family(name: str) -> bool:
        return name == "ShardcheckError" or any(in_family(b) for b in found.get(name, ("", []))[1])

    found = _exception_classes()
    assert len(found) >= 15, sorted(found)  # the walker sees them
    # Unsupported is pytest's skip (a BaseException: `except Exception` must not swallow it), an outcome
    outside = sorted(f"{path}: {name}" for name, (path, _) in found.items() if not in_family(name))
    assert outside == ["shardcheck/conformance/protocol/outcomes.py: Unsupported"]


def test_an_error_of_ours_reaching_the_command_line_is_its_status(monkeypatch, capsys):
    from shardcheck.conformance.report.merge import PartsError

    def refuse(args):
        raise PartsError("part 2 of 2 missing")

    monkeypatch.setattr(cli.COMMANDS["diff"], "main", refuse)
    assert cli.main(["diff", "a.json", "b.json"]) == PartsError.exit_status == codes.PARTS
    assert capsys.readouterr().err == "shardcheck: part 2 of 2 missing\n"
    assert issubclass(PartsError, ShardcheckError)


def test_pytests_statuses_become_ours():
    assert [codes.of_pytest(c) for c in range(6)] == [codes.OK, codes.FAILED, codes.INTERRUPTED, codes.FAILED,
                                                      codes.USAGE, codes.NO_CELL]


def test_the_report_upgrade_status_for_an_unwritable_path_is_runs(folder, capsys):
    """The case issue 63 names: `report upgrade` to an unwritable path ended 2 where `run` ended 3."""
    report = json.loads((ROOT / "reports" / "cpu-gloo-fsdp1.json").read_text())
    (folder / "r.json").write_text(json.dumps(report))
    assert cli.main(["report", "upgrade", "r.json", "-o", "afile/r.json"]) == codes.UNWRITABLE
    assert cli.main(["run", *ONE_CELL, "-o", "afile/r.json"]) == codes.UNWRITABLE
