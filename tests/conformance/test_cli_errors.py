"""`shardcheck run` and `shardcheck report assemble` on bad input: one line on stderr, a non-zero exit,
nothing run, no false "report written", no invalid report; two runs never share a report file; a
cell's message is bounded; a thin run fails under --min-coverage."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import warm_python
from shardcheck.conformance.cli import exit_codes as codes
from shardcheck.conformance.cli import main as cli
from shardcheck.conformance.report import reading
from shardcheck.conformance.report import writer as reporting

ROOT = Path(__file__).resolve().parents[2]
SHARDCHECK = [sys.executable, "-m", "shardcheck.conformance.cli"]
ONE_CELL = ("--family", "comm_hooks", "--world-sizes", "2", "-k", "default_communication_hook_behavior and NO_SHARD")


def _run(*args: str) -> warm_python.Completed:
    return warm_python.run([*SHARDCHECK[1:], *args], cwd=ROOT, timeout=300)  # its own process, started warm


def _one_line_error(proc, *words, code: int = codes.USAGE) -> str:
    assert proc.returncode == code, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr and "INTERNALERROR" not in proc.stdout, proc.stderr
    assert all(w in lines[0] for w in words), lines[0]
    assert "report written" not in proc.stdout and "passed" not in proc.stdout  # no cell ran
    return lines[0]


def test_output_that_is_a_directory_is_one_line_before_any_cell(tmp_path, capsys):
    assert cli.main(["run", *ONE_CELL, "-o", str(tmp_path)]) == codes.UNWRITABLE  # returns before pytest starts
    captured = capsys.readouterr()
    assert captured.err == f"shardcheck: -o/--output: cannot write the report: {tmp_path} is a directory\n"
    assert "report written" not in captured.out


def test_unwritable_output_is_one_line_before_any_cell(tmp_path):
    (tmp_path / "file").write_text("")
    _one_line_error(_run("run", *ONE_CELL, "-o", str(tmp_path / "file" / "r.json")), "-o/--output",
                    "not a directory", code=codes.UNWRITABLE)
    assert reporting.unwritable(tmp_path / "file" / "r.json") == f"{tmp_path / 'file'}: not a directory"
    assert reporting.unwritable(tmp_path / "ok" / "r.json") is None
    assert list((tmp_path / "ok").iterdir()) == []  # the probe leaves nothing behind


def test_a_report_another_live_run_writes_is_refused(tmp_path):
    out = tmp_path / "r.json"
    held = reporting.lock_stream(reporting.stream_path(out))  # what a live run's writer holds
    try:
        _one_line_error(_run("run", *ONE_CELL, "-o", str(out)), "another shardcheck run is writing",
                        code=codes.UNWRITABLE)
        with pytest.raises(reporting.StreamError, match="another shardcheck run"):
            reporting.lock_stream(reporting.stream_path(out))
    finally:
        held.close()
    reporting.lock_stream(reporting.stream_path(out)).close()  # free again once the run ended


def test_default_report_names_carry_the_process_id(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "reports").write_text("")  # a file where reports/ should be: stops before pytest
    assert cli.main(["run", *ONE_CELL]) == codes.UNWRITABLE
    err = capsys.readouterr().err
    assert err.startswith("shardcheck: -o/--output: cannot write the report: reports: not a directory")
    monkeypatch.setattr(reporting, "unwritable", lambda path: str(path))  # report the name it chose
    assert cli.main(["run", *ONE_CELL]) == codes.UNWRITABLE
    name = capsys.readouterr().err.strip().rsplit("/", 1)[1]
    stamp, pid = name.removeprefix("reference-gloo-").removesuffix(".json").rsplit("-", 1)
    assert pid == str(__import__("os").getpid()) and len(stamp) == len("20260101-000000")


@pytest.mark.parametrize("args, words", [
    (("--impl", ""), ("argument --impl", "empty implementation name")),
    (("--impl", "  "), ("argument --impl", "empty implementation name")),
    (("--world-sizes", "abc"), ("argument --world-sizes", "'abc' is not a comma-separated list")),
    (("--world-sizes", "2,0"), ("argument --world-sizes",)),
    (("--min-coverage", "120"), ("argument --min-coverage", "percentage")),
], ids=["empty-impl", "blank-impl", "world-sizes-abc", "world-size-0", "coverage-over-100"])
def test_bad_option_values_are_usage_errors_naming_the_option(args, words, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["run", "--family", "comm_hooks", *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and all(w in err.splitlines()[-1] for w in words), err


@pytest.mark.parametrize("content, words", [
    (b"", "not a shardcheck stream: empty"),
    (b'{"kind": "cell", "nodeid": "t.py::c", "outcome": "passed", "family": "t"}\n', "no header line"),
    (b"\xff\xfe\x00garbage\n", "not UTF-8"),
    (b'{"kind": "header", "schema_version": 1}\n', "cannot make a valid report: $: 'suite' is a required"),
], ids=["empty", "header-less", "not-utf8", "header-fails-schema"])
def test_assemble_of_a_stream_without_a_report_is_one_line_and_writes_nothing(tmp_path, capsys, content, words):
    stream = tmp_path / "s.jsonl"
    stream.write_bytes(content)
    assert cli.main(["report", "assemble", str(stream)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err and err.startswith(f"shardcheck: {stream}: "), err
    assert not (tmp_path / "s.json").exists()


def test_a_huge_message_is_bounded_head_and_tail():
    text = "HEAD" + "x" * 200_000 + "TAIL"
    out = reporting.bounded(text)
    assert len(out) <= reporting.MESSAGE_LIMIT and out.startswith("HEAD") and out.endswith("TAIL")
    assert "characters cut by shardcheck" in out
    assert reporting.bounded("short") == "short"


def test_a_thin_run_fails_under_min_coverage(tmp_path):
    out = tmp_path / "t.json"
    proc = _run("run", *ONE_CELL, "--impl", "ddp", "--impl", "reference", "--min-coverage", "50", "-o", str(out),
                "--workers", "0")  # one cell each: xdist workers would only add their start-up
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "shardcheck: ddp: coverage 0.0% (0 of 1 cells reached a verdict) is below --min-coverage 50%")
    assert "reference" not in proc.stderr
    assert "ddp" in proc.stdout and "0.0%" in proc.stdout  # the coverage table
    report = json.loads(out.read_text())
    assert reading.validate(report) is None
    assert report["summary"]["by_impl"]["ddp"]["api"]["coverage"] == 0.0
    assert report["summary"]["by_impl"]["reference"]["all"]["conformance"] == 100.0


def test_the_lock_dies_with_the_run_even_when_a_forked_rank_lives_on(tmp_path):
    code = f"""
import os, time
from pathlib import Path
from shardcheck.conformance.report import writer
stream = writer.lock_stream(Path({str(tmp_path / 'r.jsonl')!r}))
child = os.fork()
if child == 0:
    time.sleep(60)
    os._exit(0)
Path({str(tmp_path / 'pid')!r}).write_text(str(child))
os._exit(0)
"""
    subprocess.run([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   timeout=60, check=True)
    rank = int((tmp_path / "pid").read_text())
    try:
        reporting.lock_stream(tmp_path / "r.jsonl").close()  # free: the rank does not hold it
    finally:
        __import__("os").kill(rank, 9)


def test_simulate_to_an_unwritable_path_is_one_line_before_the_simulation(tmp_path):
    (tmp_path / "afile").write_text("")
    proc = _run("simulate", "--impl", "reference", "--world-size", "8", "--model", "tiny",
                "-o", str(tmp_path / "afile" / "s.json"))
    line = _one_line_error(proc, "-o/--output", "not a directory", code=codes.UNWRITABLE)
    assert "simulate" not in proc.stdout and line.startswith("shardcheck: ")  # nothing simulated first


@pytest.mark.parametrize("args", [["--version"], ["--help"], ["simulate", "--help"]])
def test_version_and_help_do_not_import_torch(args):
    proc = subprocess.run([*SHARDCHECK, *args], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={"PYTHONPROFILEIMPORTTIME": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    assert "| torch\n" not in proc.stderr  # -X importtime: torch never imported
    if args == ["--version"]:
        assert proc.stdout.startswith("shardcheck 0.1.0 (torch 2.") and "Python 3." in proc.stdout, proc.stdout


def test_default_report_names_hold_no_colon_or_bracket(tmp_path):
    adapter = "shardcheck.conformance.examples.allreduce_engine:AllReduceAdapter"
    proc = warm_python.run([*SHARDCHECK[1:], "run", "--impl", adapter, "--impl", "torch-fsdp1[flat]", *ONE_CELL,
                            "--workers", "0"],
                           cwd=tmp_path, timeout=300)
    (report,) = (tmp_path / "reports" / "local").glob("*.json")
    assert report.name.startswith("shardcheck.conformance.examples.allreduce_engine_AllReduceAdapter+torch-fsdp1_flat_-gloo-"), \
        proc.stdout + proc.stderr


BAD_INPUT = [  # (arguments, exit status, a phrase of the one line on stderr)
    (["run", "--world-sizes", "0"], codes.USAGE, "not a comma-separated list of positive integers"),
    (["run", "--family", "nope"], codes.UNKNOWN_NAME, "unknown family nope"),
    (["run", "--impl", "nope"], codes.UNKNOWN_NAME, "unknown implementation 'nope'"),
    (["run", "--impl", "torch-fsdp1[nope]"], codes.UNKNOWN_NAME, "has no variant 'nope'"),
    (["run", "--impl", "broken_adapter:Adapter"], codes.ADAPTER_IMPORT, "raised ValueError: no engine here"),
    (["run", "--impl", "broken_syntax:Adapter"], codes.ADAPTER_IMPORT, "raised SyntaxError"),
    (["run", "--impl", "broken_dependency:Adapter"], codes.ADAPTER_IMPORT,
     "importing broken_dependency:Adapter raised ModuleNotFoundError: No module named 'no_such_engine_x'"),
    (["run", "--impl", "broken_init:Adapter"], codes.ADAPTER_IMPORT, "calling broken_init:Adapter raised KeyError: 'rank'"),
    (["run", "--impl", "incomplete:Adapter"], codes.ADAPTER_IMPORT, "Adapter.full_params missing"),
    (["run", "--impl", "incomplete:Custom"], codes.ADAPTER_IMPORT, "MyTrainer.step, MyTrainer.save missing"),
    (["run", "--impl", "misspelled:Adapter"], codes.UNKNOWN_NAME, "ful_shard (did you mean full_shard?)"),
    (["run", "--impl", "no_such_module:Adapter"], codes.UNKNOWN_NAME, "No module named 'no_such_module'"),
    (["run", "--world-sizes", "7", *ONE_CELL[:2]], codes.NO_CELL, "no cell selected"),
    (["run", "-o", "afile/r.json", *ONE_CELL], codes.UNWRITABLE, "not a directory"),
    (["matrix", "nothere.json"], codes.USAGE, "nothere.json"),
]


BROKEN_INIT = """
class Adapter:
    name, version, capabilities = "mine", "0", frozenset({"no_shard"})

    def __init__(self):
        import os
        self.rank = os.environ["rank"]  # a mistake in the adapter's constructor: a KeyError, not an ImportError

    def trainer(self, model, spec, recipe):
        raise NotImplementedError
"""
INCOMPLETE = """
from shardcheck.conformance.protocol import TorchStyleAdapter


class Adapter(TorchStyleAdapter):  # full_params forgotten
    name, version, capabilities = "mine", "0", frozenset({"no_shard"})

    def shard(self, model, spec):
        return model

    def full_grads(self, model):
        return {}


class MyTrainer:  # step and (declared checkpoint) save forgotten
    def forward_backward(self, batch): ...
    def full_grads(self): ...
    def full_params(self): ...
    def load(self, path): ...
    def full_state_dict(self): ...
    def full_optimizer_state(self): ...


class Custom:
    name, version, capabilities = "custom", "0", frozenset({"no_shard", "checkpoint"})

    def trainer(self, model, spec, recipe) -> MyTrainer:
        return MyTrainer()
"""


@pytest.mark.parametrize("args, code, phrase", BAD_INPUT, ids=[" ".join(a[:3]) for a, _, _ in BAD_INPUT])
def test_bad_input_is_one_line_its_own_exit_status_and_no_file(tmp_path, args, code, phrase):
    (tmp_path / "afile").write_text("")
    (tmp_path / "broken_adapter.py").write_text("raise ValueError('no engine here')\n")
    (tmp_path / "broken_syntax.py").write_text("def adapter(:\n")
    (tmp_path / "broken_dependency.py").write_text("import no_such_engine_x\n")
    (tmp_path / "broken_init.py").write_text(BROKEN_INIT)
    (tmp_path / "incomplete.py").write_text(INCOMPLETE)
    (tmp_path / "misspelled.py").write_text(INCOMPLETE.replace('"no_shard"', '"ful_shard"'))
    before = sorted(p.name for p in tmp_path.rglob("*"))
    proc = warm_python.run([*SHARDCHECK[1:], *args], cwd=tmp_path, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == code and len(lines) == 1 and phrase in lines[0], (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr + proc.stdout and "INTERNALERROR" not in proc.stdout
    assert sorted(p.name for p in tmp_path.rglob("*") if "__pycache__" not in str(p)) == before  # nothing left


def test_simulate_finds_an_adapter_in_the_users_folder_as_run_does(tmp_path):
    """The console script (which, unlike `python -m`, does not put the working folder on the import
    path) imports `mypkg.adapter:MyAdapter` from the project's folder for simulate as for run."""
    script = Path(sys.executable).with_name("shardcheck")
    if not script.exists():
        pytest.skip(f"no console script beside {sys.executable}")
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "adapter.py").write_text("from shardcheck.conformance.adapters.reference import ReferenceAdapter as MyAdapter\n")
    proc = subprocess.run([str(script), "simulate", "--impl", "mypkg.adapter:MyAdapter", "--world-size", "8",
                           "--model", "tiny"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "2 passed" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_workers_without_pytest_xdist_is_one_line_before_any_cell(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "xdist", None)  # as in an environment without it (a release's)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["run", *ONE_CELL, "--workers", "2", "-o", str(tmp_path / "r.json")])
    captured = capsys.readouterr()
    assert exit_.value.code == codes.USAGE and captured.err.strip() == (
        "shardcheck run: argument --workers: 2 workers need pytest-xdist (pip install pytest-xdist, "
        "or the test extra) (--help lists the options)")
    assert not (tmp_path / "r.json").exists() and "passed" not in captured.out
