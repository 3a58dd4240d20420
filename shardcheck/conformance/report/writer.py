"""Conformance reports: every cell appended to a JSON-lines file as it finishes (nothing is lost if
the run crashes), and the final JSON report assembled from it at the end of the session.

Enabled with `--shardcheck-report PATH` (what `shardcheck run` passes). The cells go to PATH + "l"
(`report.json` -> `report.jsonl`): a "header" line, a "collected" line with the number of cells the
session will run, a "split" line when it runs one part of a split selection (--shardcheck-split,
shardcheck.conformance.report.split), one "cell" line per finished cell, an "interrupted" line the moment a Ctrl-C
reaches pytest, and a "footer" line when the session ends. `assemble(jsonl)` rebuilds the report
from the lines alone (also `shardcheck report assemble`). A report is `complete` only when every
collected cell has its line and nothing says the run was stopped: however the signals fall (a
second Ctrl-C inside pytest's own interrupt handling leaves it an exit status of 0), a run that
finished fewer cells than it collected is never complete.

Under pytest-xdist the controller writes the report: the workers' reports are replayed on it, so
everything a cell needs travels in `report.user_properties` (JSON-able values only).

The writer holds an exclusive lock (fcntl.flock) on the JSON-lines file for the whole session: a
second run given the same report path stops with a usage error before any cell runs, instead of
mixing its cells into the first run's stream. A report path that is a directory or cannot be
written is a usage error too. A streamed cell's `message` keeps at most MESSAGE_LIMIT characters; the
report keeps it trimmed (shardcheck.conformance.report.texts) and says in `full_text` which stream has it whole.
The report is of the current schema version (SCHEMA_VERSION: report/schema.json's, through
shardcheck.conformance.report.reading), its cells as short rows (shardcheck.conformance.report.compact).
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from shardcheck.conformance.expectations import judged_releases
from shardcheck.conformance.protocol.outcomes import BAD, outcome_of
from shardcheck.conformance.report import compact, coverage, reading, split, texts
from shardcheck.conformance.report.reading import SCHEMA_VERSION
from shardcheck.conformance.report.stream import StreamError, lock_stream, stream_path, unwritable  # callers reach them here too
from shardcheck.conformance.report.texts import KNOWN_FAILURE_LIMIT, MESSAGE_LIMIT, bounded
from shardcheck.conformance.report.cells import nodeid_of
from shardcheck.session_state import of

HEAD = ("suite", "started", "implementations", "target", "finished", "duration_s", "complete", "exit_status", "split")
PARAMS_PROPERTY = "shardcheck_params"  # the user property carrying a cell's parameters
WRITER = "shardcheck-report-writer"  # the writer's name among the session's plugins
SUITE_VERSION = "0.1.0"
RECORDED_ENV = ("SHARDCHECK_BACKEND", "SHARDCHECK_IMPL", "SHARDCHECK_LAUNCH", "CUDA_VISIBLE_DEVICES",
                "WORLD_SIZE", "SLURM_JOB_ID")  # named variables only: never the whole environment


def _jsonable(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return getattr(value, "name", None) or str(value)


def _margin(errors: list[dict]) -> float | None:
    """The largest share of its tolerance any comparison of the cell used (compare.assert_close's
    `margin`), as JSON holds it: a number (an infinite one, a NaN on one side only, as the largest
    float), or None when no comparison recorded one."""
    worst = _largest(e.get("margin") for e in errors)
    return None if worst is None else min(worst, compact.LARGEST) if not math.isnan(worst) else compact.LARGEST


def _footprint(per_rank: dict) -> dict | None:
    """Of the sharding family's figures (`ctx.record("footprint", ...)` on every rank), those of the
    rank that held the most between steps, with its number; None when no rank measured."""
    held = {int(rank): figures[-1] for rank, figures in per_rank.items() if figures}
    if not held:
        return None
    rank = max(held, key=lambda r: (held[r]["rest"]["measured"], -r))
    return _jsonable({"rank": rank, **held[rank]})


def _largest(values) -> float | None:
    """The largest measured error over every rank's comparisons; NaN wins (max() would drop a NaN
    that is not first); None when nothing was compared."""
    values = [float(v) for v in values if v is not None]
    if not values:
        return None
    return math.nan if any(math.isnan(v) for v in values) else max(values)


def family_of(nodeid: str) -> str:
    """`shardcheck/conformance/checks/test_clip_grad_dtensor.py::...` -> `clip_grad`."""
    from shardcheck.conformance.checks import family_of_file

    return family_of_file(Path(nodeid.split("::")[0]).stem)


def _message(report, outcome: str) -> str:
    """A skip's reason alone (no `(path, line, ...)` tuple); the failure text otherwise, without
    pytest-xdist's worker line; bounded."""
    if outcome in ("skipped", "unsupported") and isinstance(report.longrepr, tuple):
        return bounded(str(report.longrepr[2]).removeprefix("Skipped: "))
    if outcome in BAD or outcome == "xfailed":
        return bounded(texts.without_worker_line(report.longreprtext))
    return ""


class ReportWriter:
    def __init__(self, config, path: Path):
        self.config, self.path = config, path
        self.lines = stream_path(path)
        self.stream = lock_stream(self.lines)  # held until the session ends
        self.started = dt.datetime.now(dt.timezone.utc)

    def pytest_sessionstart(self, session):  # every plugin is configured by now
        self._append({"kind": "header", **self.header()})
        self.collected, self.split_said = None, False

    def pytest_collection_finish(self, session):  # a plain session (xdist's controller collects nothing)
        self._collected(len(session.items))
        self._split(session.config.stash.get(split.RECORD, None))

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node, error):  # a pytest-xdist worker's split (all make the same)
        self._split(getattr(node, "workeroutput", {}).get(split.WORKER_OUTPUT))

    def _split(self, record: dict | None) -> None:
        """`--shardcheck-split K/N` (shardcheck.conformance.report.split): which part this run is, once."""
        if record is not None and not self.split_said:
            self.split_said = True
            self._append({"kind": "split", **record})

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node, ids):  # every worker collects the same cells
        self._collected(len(ids))

    def _collected(self, count: int) -> None:
        if self.collected is None:
            self.collected = count
            self._append({"kind": "collected", "count": count})

    def pytest_keyboard_interrupt(self, excinfo):
        """Said at once: a second Ctrl-C may cut pytest's own handling short, footer included."""
        self._append({"kind": "interrupted"})

    def _append(self, entry: dict) -> None:
        self.stream.write(json.dumps(entry) + "\n")
        self.stream.flush()

    def header(self) -> dict:
        selection = of(self.config).selection  # loaded for the report (selection.pytest_sessionstart)
        impls = selection.impls if selection else {}
        return {
            "schema_version": SCHEMA_VERSION,
            "suite": {"name": "shardcheck", "version": SUITE_VERSION, "git_revision": _git_revision()},
            "started": self.started.isoformat(),
            "implementations": [{"name": a.name, "selected_as": n, "version": a.version,
                                 "adapter": f"{type(a).__module__}:{type(a).__qualname__}",
                                 "capabilities": sorted(a.capabilities)} for n, a in impls.items()],
            "target": {**_target(self.config), "unjudged": judged_releases.unjudged(_torch_version(), list(impls))},
        }

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_logreport(self, report):
        outcome = outcome_of(report)
        if outcome is None or (report.when == "teardown" and outcome == "skipped"):
            return
        props = dict(report.user_properties)
        params = dict(props.get(PARAMS_PROPERTY) or {})
        errors = [e for per_rank in props.get("error", {}).values() for e in per_rank
                  if isinstance(e, dict) and "max_abs" in e]
        nodeid = nodeid_of(report)
        cell = {
            "kind": "cell", "nodeid": nodeid, "phase": report.when, "outcome": outcome,
            "family": family_of(nodeid), "layer": coverage.layer_of(family_of(nodeid)),
            "check": nodeid.split("::")[-1].split("[")[0],
            "impl": params.pop("impl", None), "world_size": params.get("world_size"),
            "params": params, "duration_s": round(report.duration, 4),
            "message": _message(report, outcome),
            "rank_outcomes": _jsonable(props.get("rank_outcomes", {})),
            "max_abs_err": _jsonable(_largest(e["max_abs"] for e in errors)),
            "max_rel_err": _jsonable(_largest(e["max_rel"] for e in errors)),
            "max_margin": _margin(errors),
            "footprint": _footprint(props.get("footprint", {})),
            "tolerances": sorted({(e["rtol"], e["atol"]) for e in errors if e["rtol"] is not None}),
            "expectation": _jsonable(props.get("expectation")),
        }
        self._append(cell)
        if props.get("explore") and report.when == "call":  # the explore family's search (shardcheck/conformance/explore/): its own line
            self._append({"kind": "explore", **_jsonable({"nodeid": nodeid, **props["explore"]})})

    def pytest_sessionfinish(self, session, exitstatus):
        stopped = bool(session.shouldstop or session.shouldfail) or exitstatus not in (0, 1, 5)  # -x, ^C
        self._append({"kind": "footer", "finished": dt.datetime.now(dt.timezone.utc).isoformat(),
                      "exit_status": int(exitstatus), "interrupted": stopped})
        try:
            write(assemble(self.lines, self.path), self.path)
        finally:
            self.stream.close()  # releases the lock


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """The cell's parameters, JSON-able, as a user property: it survives xdist's serialisation."""
    outcome = yield
    rep = outcome.get_result()
    params = dict(getattr(item, "callspec", None).params) if hasattr(item, "callspec") else {}
    if "impl" not in params:
        return  # not a conformance cell: another project's test keeps its properties as they were
    params["impl"] = params["impl"].name
    params.pop("shardcheck_backend", None)
    rep.user_properties.append((PARAMS_PROPERTY, {k: _jsonable(v) for k, v in params.items()}))


def report_text(cell: dict) -> str:
    """What the report keeps of a cell's message: trimmed (shardcheck.conformance.report.texts), an xfailed
    cell's blocks bounded to KNOWN_FAILURE_LIMIT (its expectation carries the reason and repro)."""
    return texts.trim(cell["message"], KNOWN_FAILURE_LIMIT if cell["outcome"] == "xfailed" else MESSAGE_LIMIT)


def compose(head: dict, cells: list[dict], full_text: str | None, explore: list[dict] | None = None) -> dict:
    """The report, of the current schema version (SCHEMA_VERSION): `head`'s HEAD fields, the summary,
    and the cells (full, as streamed) as rows (shardcheck.conformance.report.compact), their texts
    trimmed; `explore`: the explore family's searches, when it ran."""
    summary: dict = {"by_outcome": {}, "by_family": {}, "by_impl": coverage.by_impl(cells)}
    for cell in cells:
        summary["by_outcome"][cell["outcome"]] = summary["by_outcome"].get(cell["outcome"], 0) + 1
        fam = summary["by_family"].setdefault(cell["family"], {})
        fam[cell["outcome"]] = fam.get(cell["outcome"], 0) + 1
    kept = [{**cell, "message": report_text(cell)} for cell in cells]
    return {"schema_version": SCHEMA_VERSION, **{k: head[k] for k in HEAD if k in head}, "full_text": full_text,
            "summary": summary, **compact.encode(kept, head.get("implementations") or [], texts.pieces),
            "cell_columns": list(compact.COLUMNS), **({"explore": explore} if explore else {})}


def rewrite(report: dict, full_text: str | None) -> dict:
    """A report as `reading.load` gives it (any version) as the version the writer writes."""
    return compose(report, report["cells"], full_text)


def assemble(lines: Path, report: Path | None = None) -> dict:
    """The report from a JSON-lines file; `complete` only when the session wrote its footer, was not
    stopped early (-x, Ctrl-C), no line was cut short, and every collected cell finished. A killed
    run's `finished` is the time of its last line, its `exit_status` null. `full_text` names `lines`
    from the folder of `report` (default: beside it)."""
    header, footer, cells, explore, torn, parted = None, None, {}, [], False, None
    collected, interrupted = None, False
    try:
        text = lines.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise StreamError(f"{lines}: not a shardcheck stream: not UTF-8 ({exc.reason} at byte {exc.start})") from None
    for line in text.splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            torn = True  # a line cut short by a crash
            continue
        if not isinstance(entry, dict):
            torn = True
            continue
        kind = entry.pop("kind", None)
        if kind == "header":
            header = entry
        elif kind == "footer":
            footer = entry
        elif kind == "cell":
            entry.setdefault("layer", coverage.layer_of(entry.get("family", "")))  # a version 1 stream
            prev = cells.get(entry["nodeid"])
            if prev is None or prev["outcome"] == "passed":  # a teardown error overrides a pass
                cells[entry["nodeid"]] = entry
        elif kind == "explore":
            explore.append(entry)
        elif kind == "split":
            parted = entry
        elif kind == "collected":
            collected = entry.get("count")
        elif kind == "interrupted":
            interrupted = True
    if header is None:
        raise StreamError(f"{lines}: not a shardcheck stream: "
                          + ("empty" if not text.strip() else "no header line (a run writes one first)"))
    problem = next(filter(None, map(reading.cell_problem, cells.values())), None)
    if problem:
        raise StreamError(f"{lines}: not a shardcheck cell: {problem}")
    if footer:
        finished = dt.datetime.fromisoformat(footer["finished"])
    else:
        finished = dt.datetime.fromtimestamp(lines.stat().st_mtime, dt.timezone.utc)
    started = dt.datetime.fromisoformat(header.get("started", finished.isoformat()))
    head = {**header, "finished": finished.isoformat(), "duration_s": (finished - started).total_seconds(),
            "complete": (footer is not None and not footer.get("interrupted") and not interrupted and not torn
                         and (collected is None or len(cells) >= collected)),
            "exit_status": _exit_status(footer, interrupted or (collected is not None and len(cells) < collected)),
            **({"split": parted} if parted else {})}
    folder = (report or lines).absolute().parent
    return compose(head, list(cells.values()), os.path.relpath(lines.absolute(), folder), explore)


def _exit_status(footer: dict | None, stopped: bool) -> int | None:
    """The session's exit status; pytest's INTERRUPTED for a session stopped short (a Ctrl-C seen, or
    fewer cells finished than collected) whose footer says 0 (a second Ctrl-C inside pytest's handling
    of the first leaves its status at 0); None without a footer (killed)."""
    if footer is None:
        return None
    return int(pytest.ExitCode.INTERRUPTED) if stopped and footer["exit_status"] == 0 else footer["exit_status"]


def write(report: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(compact.dump_report(report))


def _git_revision() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, text=True,
                              capture_output=True, timeout=5, check=False).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _torch_version() -> str:
    import torch

    return torch.__version__


def _target(config) -> dict:
    import torch  # here, not at the top: the plugin loads in every session of the environment

    from shardcheck.harness import cuda as cuda_probe
    from shardcheck.harness.devices import thread_device_type

    # This process forks ranks: what it knows of CUDA comes from NVML (shardcheck.harness.cuda).
    names = cuda_probe.device_names()
    harness = of(config).harness
    backends = list(harness.backends) if harness else []
    on_gpu = bool(names) and ("nccl" in backends or ("threaded" in backends and thread_device_type() == "cuda"))
    return {
        "backends": list(harness.backends) if harness else None,
        "device_type": "cuda" if on_gpu else "cpu",
        "device_model": names[0] if on_gpu else platform.processor() or platform.machine(),
        "world_sizes": sorted((harness.sizes if harness else None) or []) or "all",
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if on_gpu and "nccl" in backends else None,
        "python": sys.version.split()[0], "platform": platform.platform(),
        "env": {k: os.environ[k] for k in RECORDED_ENV if k in os.environ},
    }


def pytest_configure(config):
    from shardcheck.harness.launcher import detect

    path = config.getoption("shardcheck_report")
    launch = detect()
    if path and not hasattr(config, "workerinput") and (launch is None or launch.rank == 0):
        problem = unwritable(Path(path))
        if problem:
            raise pytest.UsageError(f"--shardcheck-report: cannot write the report: {problem}")
        try:
            writer = ReportWriter(config, Path(path))
        except (StreamError, OSError) as exc:
            raise pytest.UsageError(f"--shardcheck-report: {exc}") from None
        config.pluginmanager.register(writer, WRITER)
