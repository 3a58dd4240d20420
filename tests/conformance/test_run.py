"""`shardcheck run` and `shardcheck report assemble`: progress on a terminal and in logs, a summary
table, the exit code, one merged report under pytest-xdist, a killed run's report rebuilt from its
stream, and no environment variable recorded unless it is named."""

from __future__ import annotations

import argparse
import io
import json
import os
import pty
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import warm_python
from rich.console import Console

from shardcheck.conformance.cli import exit_codes as codes
from shardcheck.conformance.cli import main as cli
from shardcheck.conformance.cli import run as run_command
from shardcheck.conformance.report import reading
from shardcheck.conformance.report import writer as reporting
from shardcheck.harness import cuda
from shardcheck.conformance.cli.progress import RunProgress
from shardcheck.conformance.expectations.manifest import NO_REASON
from shardcheck.conformance.protocol.outcomes import MISSING_PROPERTY
from shardcheck.conformance.report.writer import PARAMS_PROPERTY

ROOT = Path(__file__).resolve().parents[2]
SHARDCHECK = [sys.executable, "-m", "shardcheck.conformance.cli"]
TWO_CELLS = ("--world-sizes", "2", "-k", ("test_default_communication_hook_behavior and NO_SHARD"
                                         " or test_custom_hook_called and mean and NO_SHARD"))


def _run(*args: str):
    """`shardcheck ARGS` in a process of its own that starts with torch imported (tests/warm_python.py)."""
    return warm_python.run([*SHARDCHECK[1:], *args], cwd=ROOT, timeout=300)


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _args(*impls, backend="gloo", launcher="none", **selection):
    return argparse.Namespace(impl=list(impls) or None, backend=backend, launcher=launcher,
                              **{"family": None, "world_sizes": None, "k": None, **selection})


@pytest.mark.parametrize("args, passthrough, expected", [
    (_args(), [], run_command.MAX_AUTO_WORKERS),                 # one implementation's whole matrix: a worker per core
    (_args(family="clip_grad"), [], 0),                  # a selection of its cells: in this process
    (_args(world_sizes=[2]), [], 0),
    (_args("reference", k="NO_SHARD"), [], 0),
    (_args("reference", "ddp", family="clip_grad"), [], 2),  # several implementations: workers all the same
    (_args("reference", "ddp"), [], 2),                  # several: a worker per core, at most one each
    (_args("reference", "ddp", "deepspeed"), [], 3),
    (_args("all"), [], run_command.MAX_AUTO_WORKERS),
    (_args("all"), ["-n", "3"], 0),                      # `-- -n`: pytest-xdist's own option decides
    (_args("all"), ["-p", "no:xdist"], 0),
    (_args("all", backend="nccl"), [], 0),               # `-- -n gpus` leases the GPUs
    (_args("all", launcher="torchrun"), [], 0),          # every launcher rank runs the cells
])
def test_auto_workers(args, passthrough, expected, monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert run_command.workers_for(args, None, passthrough) == expected
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert run_command.workers_for(args, None, passthrough) == min(expected, 2)


def test_workers_is_a_number_or_auto(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["run", "--workers", "many"])
    assert exit_.value.code == 2 and "'many' is neither a number of workers nor 'auto'" in capsys.readouterr().err


def test_failed_cell_fails_the_run_and_xdist_workers_make_one_report(tmp_path):
    out = tmp_path / "x.json"
    proc = _run("run", "--family", "comm_hooks", "--backend", "threaded", *TWO_CELLS,
                "--impl", "shardcheck.conformance.mutants:CommHookIgnored", "-o", str(out), "--", "-n", "2")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert re.search(r"^\[ +2/ +2\] 1 failed, \d+ s$", proc.stdout, re.MULTILINE), proc.stdout
    assert not re.search(r"^[.FEsxXU]+$", proc.stdout, re.MULTILINE), "pytest's per-test letters are not shown"
    assert re.search(r"comm_hooks +│ +1 │ +1 │ +2 │", proc.stdout), proc.stdout  # families x outcomes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.json", "x.jsonl"]  # no per-worker report
    kinds = [entry["kind"] for entry in _lines(tmp_path / "x.jsonl")]
    assert kinds == ["header", "collected", "cell", "cell", "footer"]  # both workers' cells, streamed by the controller
    report = reading.load(out)
    cells = {c["check"]: c for c in report["cells"]}
    assert {c: cells[c]["outcome"] for c in cells} == {"test_default_communication_hook_behavior": "passed",
                                                      "test_custom_hook_called": "failed"}
    hooked = cells["test_custom_hook_called"]  # params and rank records survived xdist's serialisation
    assert hooked["impl"] == "mutant-comm-hook-ignored"
    assert hooked["params"] == {"world_size": 2, "factor": 1.0, "strategy": "NO_SHARD"}
    assert hooked["world_size"] == 2
    assert hooked["rank_outcomes"] == {"0": "failed", "1": "failed"}
    assert "hook called 0 times" in hooked["message"]
    assert hooked["message"].startswith("rank "), hooked["message"]  # not pytest-xdist's worker line
    assert report["complete"] and report["exit_status"] == 1
    assert report["full_text"] == "x.jsonl"  # the untrimmed text: the streamed cell's message
    [streamed] = [e for e in _lines(tmp_path / "x.jsonl") if e.get("check") == "test_custom_hook_called"]
    assert "hook called 0 times" in streamed["message"] and len(streamed["message"]) >= len(hooked["message"])


def test_killed_run_is_assembled_from_its_stream(tmp_path):
    out = tmp_path / "k.json"
    stream = tmp_path / "k.jsonl"
    proc = subprocess.Popen([*SHARDCHECK, "run", "--family", "comm_hooks", "-o", str(out)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (stream.exists() and '"kind": "cell"' in stream.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended before its first cell"
            time.sleep(0.02)
        proc.kill()  # SIGKILL: no sessionfinish, no footer
        proc.wait(timeout=60)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # rank processes of the run, if any outlived it
        except ProcessLookupError:
            pass
    assert not out.exists()
    kinds = [e["kind"] for e in _lines(stream)]
    assert kinds[0] == "header" and "cell" in kinds and "footer" not in kinds
    streamed = [e for e in _lines(stream) if e["kind"] == "cell"]

    assert cli.main(["report", "assemble", str(stream)]) == 0
    report = reading.load(out)
    assert report["complete"] is False and report["exit_status"] is None
    assert [c["nodeid"] for c in report["cells"]] == [c["nodeid"] for c in streamed]
    assert report["implementations"][0]["name"] == "reference"
    assert sum(report["summary"]["by_outcome"].values()) == len(streamed)


def test_assemble_tells_a_finished_stream_from_a_torn_or_stopped_one(tmp_path, capsys):
    header = {"kind": "header", "schema_version": 2, "started": "2026-01-01T00:00:00+00:00",
              "suite": {"name": "shardcheck", "version": "0.1.0", "git_revision": None},
              "implementations": [],
              "target": {"backends": ["gloo"], "device_type": "cpu", "device_model": "x86_64",
                         "world_sizes": "all", "torch": "2.13.0", "cuda": None, "nccl": None,
                         "python": "3.11.7", "platform": "Linux", "env": {}}}
    cell = {"kind": "cell", "nodeid": "t.py::c", "phase": "call", "outcome": "passed", "family": "t",
            "layer": "other", "check": "c", "impl": None, "world_size": None, "params": {}, "duration_s": 0.1,
            "message": "", "rank_outcomes": {}, "max_abs_err": None, "max_rel_err": None, "tolerances": [],
            "expectation": None}
    footer = {"kind": "footer", "finished": "2026-01-01T00:00:10+00:00", "exit_status": 0,
              "interrupted": False}
    stream = tmp_path / "s.jsonl"
    for lines, complete in [([header, cell, footer], True), ([header, cell], False),
                            ([header, cell, {**footer, "interrupted": True, "exit_status": 2}], False)]:
        stream.write_text("".join(json.dumps(e) + "\n" for e in lines))
        assert reporting.assemble(stream)["complete"] is complete
    stream.write_text("".join(json.dumps(e) + "\n" for e in [header, cell, footer]) + '{"kind": "ce')
    report = reporting.assemble(stream)
    assert report["complete"] is False and len(report["cells"]) == 1  # a line cut short by a crash
    assert report["duration_s"] == 10.0 and report["exit_status"] == 0  # from the footer

    assert cli.main(["report", "assemble", str(stream), "-o", str(tmp_path / "out.json")]) == 0
    assert "1 cells, complete: false" in capsys.readouterr().out
    assert cli.main(["report", "assemble", str(tmp_path / "missing.jsonl")]) == 2
    assert capsys.readouterr().err.strip() == f"shardcheck: no such file: {tmp_path / 'missing.jsonl'}"


def test_usage_errors_pass_through_as_one_line(tmp_path):
    proc = _run("run", "--family", "comm_hooks", "--impl", "nope", "-o", str(tmp_path / "u.json"))
    assert proc.returncode == 4
    assert "unknown implementation 'nope'" in proc.stderr and "Traceback" not in proc.stderr


def test_progress_bar_on_a_terminal_and_no_unnamed_variable_recorded(tmp_path):
    try:
        master, slave = pty.openpty()
    except OSError:
        pytest.skip("no pseudo-terminal on this machine")
    proc = subprocess.Popen([*SHARDCHECK, "run", "--family", "comm_hooks", *TWO_CELLS, "-o",
                             str(tmp_path / "t.json")], cwd=ROOT, stdin=slave, stdout=slave, stderr=slave,
                            env={**os.environ, "COLUMNS": "100", "TERM": "xterm",
                                 "SECRET_TOKEN": "hunter2-do-not-record", "SLURM_JOB_ID": "4242"})
    os.close(slave)
    output = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: every writer closed the terminal
            break
        if not chunk:
            break
        output += chunk
    os.close(master)
    assert proc.wait(timeout=60) == 0
    text = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", output.decode())
    assert re.search(r"shardcheck ━+ 2/2 no failures \d:\d\d:\d\d", text), text
    assert re.search(r"comm_hooks +│ +2 │ +2 │", text), text  # families x outcomes
    report = json.loads((tmp_path / "t.json").read_text())
    assert report["complete"] and report["exit_status"] == 0
    assert report["summary"]["by_outcome"] == {"passed": 2}
    assert report["target"]["env"] == {"SLURM_JOB_ID": "4242"}  # named variables only
    for path in (tmp_path / "t.json", tmp_path / "t.jsonl"):
        assert "hunter2" not in path.read_text() and "SECRET_TOKEN" not in path.read_text()


def _feed(progress: RunProgress, nodeid: str, *phases: tuple) -> None:
    """Phase reports (when, outcome[, longrepr[, extra attributes]]) of one cell, as pytest makes them."""
    for when, outcome, longrepr, extra in (phase + (None, {})[len(phase) - 2:] for phase in phases):
        rep = pytest.TestReport(f"shardcheck/conformance/checks/{nodeid}", ("t.py", 0, nodeid), {}, outcome,
                                longrepr, when)
        rep.__dict__.update(extra)
        progress.pytest_runtest_logreport(rep)


def test_progress_counts_cells_and_only_failures_and_errors_fail_the_run():
    buffer = io.StringIO()
    progress = RunProgress(console=Console(file=buffer, width=120), every=2, interval_s=3600)
    progress.total = 4
    ok = [("setup", "passed"), ("call", "passed"), ("teardown", "passed")]
    _feed(progress, "test_a.py::pass", *ok)
    _feed(progress, "test_a.py::xfail", ("setup", "passed"), ("call", "skipped", None, {"wasxfail": "known"}),
          ("teardown", "passed"))
    _feed(progress, "test_b.py::unsupported", ("setup", "skipped", "unsupported: no offload"),
          ("teardown", "passed"))
    assert progress.exit_code(0) == codes.OK and progress.exit_code(4) == codes.USAGE  # pytest's usage error
    _feed(progress, "test_b.py::teardown_error", ("setup", "passed"), ("call", "passed"),
          ("teardown", "failed", "boom"))
    assert progress.by_outcome() == {"passed": 1, "xfailed": 1, "unsupported": 1, "error": 1}
    assert progress.exit_code(0) == 1 and progress.exit_code(1) == 1
    lines = buffer.getvalue().splitlines()  # the seconds elapsed are the machine's, not the test's
    assert [re.sub(r", \d+ s$", ", N s", line) for line in lines] == [
        "[  2/  4] 1 xfailed, N s", "[  4/  4] 1 error, 1 xfailed, 1 unsupported, N s"], lines
    progress.print_summary()
    assert re.search(r"│ b +│ +0 │ +1 │ +0 │ +1 │ +2 │", buffer.getvalue()), buffer.getvalue()


def test_the_summary_sets_aside_known_failures_that_are_no_bug():
    """Issue 61: `shardcheck run`'s summary says each kind apart; conformance counts bugs only."""
    buffer = io.StringIO()
    progress = RunProgress(console=Console(file=buffer, width=160), every=100, interval_s=3600)

    def cell(nodeid, finding=None):
        props = [(PARAMS_PROPERTY, {"impl": "torch-fsdp2"})]
        if finding:
            props.append(("expectation", {"reason": "r", "repro": "r.py", "finding": finding}))
            phases = [("setup", "passed"), ("call", "skipped", None, {"wasxfail": "known"}), ("teardown", "passed")]
        else:
            phases = [("setup", "passed"), ("call", "passed"), ("teardown", "passed")]
        _feed(progress, nodeid, *[(when, outcome, longrepr, {**extra, "user_properties": props})
                                  for when, outcome, longrepr, extra in (p + (None, {})[len(p) - 2:] for p in phases)])

    cell("test_a.py::ok[torch-fsdp2]")
    cell("test_a.py::bug[torch-fsdp2]", "F9")
    cell("test_a.py::buffers[torch-fsdp2]", "F48")  # by design: judged by DDP's convention
    assert progress.by_outcome() == {"passed": 1, "xfailed": 1, "by design": 1}
    total = progress.coverage()["torch-fsdp2"]["all"]
    assert (total["reached"], total["set_aside"], total["judged"], total["conformance"]) == (3, 1, 2, 50.0)
    assert progress.exit_code(0) == 0
    progress.print_summary()
    text = buffer.getvalue()
    assert "by design" in text and "set aside" in text and "50.0%" in text, text


def test_the_summary_says_why_cells_reached_no_verdict_and_nothing_reached_fails_the_run(capsys):
    buffer = io.StringIO()
    progress = RunProgress(console=Console(file=buffer, width=80), every=100, interval_s=3600)

    def cell(nodeid, impl, reason, missing=None):
        props = [(PARAMS_PROPERTY, {"impl": impl})] + ([(MISSING_PROPERTY, missing)] if missing else [])
        _feed(progress, nodeid, ("setup", "skipped", ("t.py", 1, f"Skipped: {reason}"), {"user_properties": props}),
              ("teardown", "passed", None, {"user_properties": props}))

    cell("test_a.py::c1[engine-with-a-long-name]", "engine-with-a-long-name", "unsupported: e does not declare full_shard",
         {"full_shard": "replicates only"})
    cell("test_a.py::c2[engine-with-a-long-name]", "engine-with-a-long-name",
         "unsupported: e does not declare full_shard, loss_scaling", {"full_shard": "replicates only",
                                                                      "loss_scaling": NO_REASON})
    cell("test_a.py::c3[engine-with-a-long-name]", "engine-with-a-long-name", "needs 4 devices; 1 visible")
    _feed(progress, "test_a.py::c4[reference]", ("setup", "passed", None, {"user_properties": [(PARAMS_PROPERTY, {"impl": "reference"})]}),
          ("call", "passed"), ("teardown", "passed"))
    assert progress.reason_lines() == [
        "engine-with-a-long-name: unsupported: `full_shard` is needed by 2 cells (1 of them need nothing else): "
        "replicates only",
        "engine-with-a-long-name: unsupported: `loss_scaling` is needed by 1 cell (0 of them need nothing else): "
        f"{NO_REASON}",
        "engine-with-a-long-name: 1 skipped: needs 4 devices; 1 visible"]
    assert progress.exit_code(0) == 1  # one implementation reached nothing, whatever the other did
    assert "engine-with-a-long-name reached no cell: every one of its 3 cells was skipped or unsupported" \
        in capsys.readouterr().err
    progress.print_summary()
    assert "engine-with-a-long-name" in buffer.getvalue() and "…" not in buffer.getvalue()  # never cut


def test_an_interrupted_run_says_how_far_it_got():
    buffer = io.StringIO()
    progress = RunProgress(console=Console(file=buffer, width=80), every=100, interval_s=3600)
    progress.total = 5
    _feed(progress, "test_a.py::c1", ("setup", "passed"), ("call", "passed"), ("teardown", "passed"))
    progress.pytest_keyboard_interrupt(None)
    progress.print_summary()
    assert "shardcheck: interrupted after 1 of 5 cells" in buffer.getvalue()


@pytest.mark.skipif(torch.distributed.is_nccl_available() and cuda.device_count() > 0, reason="nccl runs here")
def test_a_run_where_every_cell_is_skipped_exits_1_with_the_reason(tmp_path):
    proc = _run("run", "--backend", "nccl", "--family", "train_parity", "--world-sizes", "2", "-o",
                str(tmp_path / "r.json"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    cells = re.search(r"shardcheck: (\d+) cells", proc.stdout)
    assert cells and int(cells.group(1)) > 30, proc.stdout  # every train_parity cell at 2 ranks
    assert f"reference: {cells.group(1)} skipped: nccl" in proc.stdout, proc.stdout
    assert "reference reached no cell" in proc.stderr, proc.stderr


def test_the_report_path_is_never_taken_for_a_test_path(tmp_path):
    """`-o same.json` twice in a project folder (a pyproject.toml with pytest settings)."""
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "p"\n[tool.pytest.ini_options]\naddopts = ""\n')
    for _ in range(2):
        proc = warm_python.run([*SHARDCHECK[1:], "run", "--family", "comm_hooks", *TWO_CELLS, "-o", "same.json"],
                               cwd=tmp_path, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        report = reading.load(tmp_path / "same.json")
        assert {c["family"] for c in report["cells"]} == {"comm_hooks"} and len(report["cells"]) == 2


def test_an_adapter_in_the_users_folder_is_found_by_the_console_script(tmp_path):
    """`shardcheck run --impl mypkg.adapter:Engine` from the project's folder, as a wheel user runs it
    (the console script, unlike `python -m`, does not put the working folder on the import path)."""
    script = Path(sys.executable).with_name("shardcheck")
    if not script.exists():
        pytest.skip(f"no console script beside {sys.executable}")
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "adapter.py").write_text(
        "from shardcheck.conformance.adapters.reference import ReferenceAdapter\n\n"
        "class Engine(ReferenceAdapter):\n    name = 'my-engine'\n")
    proc = subprocess.run([str(script), "run", "--impl", "mypkg.adapter:Engine", "--family", "comm_hooks",
                           *TWO_CELLS, "-o", "r.json"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [i["name"] for i in reading.load(tmp_path / "r.json")["implementations"]] == ["my-engine"]


def test_run_on_ranks_started_by_torchrun(tmp_path):
    """`--launcher torchrun`: the matrix runs on torchrun's ranks; rank 0 alone reports."""
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "shardcheck.conformance.cli", "run", "--launcher", "torchrun",
                           "--nproc-per-node", "2", "--family", "comm_hooks", "-k",
                           "default_communication_hook_behavior", "--world-sizes", "2", "-o", str(out)],
                          capture_output=True, text=True, timeout=300)
    # all of stderr: a rank's own last words come before torchrun's summary of its exit (a rank aborted
    # in the interpreter's teardown after every cell passed, until cli/run.py left with os._exit)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr
    assert proc.stdout.count("report written to") == 1
    report = json.loads(out.read_text())
    assert report["complete"] and report["summary"]["by_outcome"] == {"passed": 3}
    assert report["target"]["env"].get("WORLD_SIZE") == "2"  # the cells ran under the launcher


HANGING_ADAPTER = '''
import time
import torch.distributed as dist
from shardcheck.conformance.adapters.reference import ReferenceAdapter

class Hangs(ReferenceAdapter):
    name = "hangs"

    def trainer(self, *args, **kwargs):
        if dist.get_rank() == 1:
            time.sleep(600)
        return super().trainer(*args, **kwargs)
'''


def test_a_hanging_candidate_fails_its_cell_at_the_deadline_and_the_progress_names_it(tmp_path):
    """While the ranks are overdue, the progress line names the cell, its ranks and the option; the
    cell then fails with every rank's stack, naming the option to raise."""
    (tmp_path / "hangs.py").write_text(HANGING_ADAPTER)
    cell = "test_train_parity[hangs:Hangs-ws2-FULL_SHARD-noclip-nested]"
    proc = warm_python.run([*SHARDCHECK[1:], "run", "--impl", "hangs:Hangs", "--family", "train_parity",
                            "--world-sizes", "2", "-k", "FULL_SHARD and noclip and nested", "--rank-timeout", "4",
                            "--workers", "0", "-o", "r.json"], cwd=tmp_path, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    waiting_lines = [line for line in proc.stdout.splitlines() if "waiting" in line]
    assert waiting_lines, proc.stdout
    assert re.search(rf"waiting \d+ s on \S*{re.escape(cell)}: ranks 0, 1 of 2 not answered \(deadline 4 s, "
                     r"--rank-timeout\)", waiting_lines[0]), waiting_lines
    report = reading.load(tmp_path / "r.json")
    assert report["summary"]["by_outcome"] == {"failed": 1}, report["summary"]
    assert "did not finish within the 4 s deadline" in proc.stdout and "--shardcheck-rank-timeout" in proc.stdout
