"""Conformance reports: every cell appended to a JSON-lines file as it finishes (nothing is lost if
the run crashes), and the final JSON report assembled from it at the end of the session.

Enabled with `--shardcheck-report PATH` (what `shardcheck run` passes). The cells go to PATH + "l"
(`report.json` -> `report.jsonl`); `assemble(jsonl)` rebuilds the report from the lines alone, so an
interrupted run still yields one, marked `complete: false`.
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
import torch

SCHEMA_VERSION = 1
SUITE_VERSION = "0.1.0"
RECORDED_ENV = ("SHARDCHECK_BACKEND", "SHARDCHECK_IMPL", "SHARDCHECK_LAUNCH", "CUDA_VISIBLE_DEVICES",
                "WORLD_SIZE", "SLURM_JOB_ID")  # named variables only: never the whole environment


def pytest_addoption(parser):
    parser.getgroup("shardcheck-conformance").addoption(
        "--shardcheck-report", default=None, metavar="PATH",
        help="write a JSON conformance report to PATH (cells stream to PATH + 'l' as JSON lines)")


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


def _outcome(report) -> str | None:
    from conformance.adapter import UNSUPPORTED_PREFIX

    if hasattr(report, "wasxfail"):
        return "xfailed" if report.skipped else "xpassed"
    if report.when == "call":
        return report.outcome
    if report.outcome == "skipped":
        return "unsupported" if UNSUPPORTED_PREFIX in str(report.longrepr) else "skipped"
    if report.outcome == "failed":
        return "error"
    return None  # a passed setup/teardown: the call phase reports the cell


class ReportWriter:
    def __init__(self, config, path: Path):
        self.config, self.path = config, path
        self.lines = path.with_suffix(path.suffix + "l")
        path.parent.mkdir(parents=True, exist_ok=True)
        self.started = dt.datetime.now(dt.timezone.utc)

    def pytest_sessionstart(self, session):  # every plugin is configured by now
        self.lines.write_text(json.dumps({"kind": "header", **self.header()}) + "\n")

    def header(self) -> dict:
        impls = getattr(self.config, "_shardcheck_impls", {})
        return {
            "schema_version": SCHEMA_VERSION,
            "suite": {"name": "shardcheck", "version": SUITE_VERSION, "git_revision": _git_revision()},
            "started": self.started.isoformat(),
            "implementations": [{"name": a.name, "selected_as": n, "version": a.version,
                                 "adapter": f"{type(a).__module__}:{type(a).__qualname__}",
                                 "capabilities": sorted(a.capabilities)} for n, a in impls.items()],
            "target": _target(self.config),
        }

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_logreport(self, report):
        outcome = _outcome(report)
        if outcome is None or (report.when == "teardown" and outcome == "skipped"):
            return
        props = dict(report.user_properties)
        params = {k: _jsonable(v) for k, v in getattr(report, "_shardcheck_params", {}).items()}
        errors = [e for per_rank in props.get("error", {}).values() for e in per_rank
                  if isinstance(e, dict) and "max_abs" in e]
        cell = {
            "kind": "cell", "nodeid": report.nodeid, "phase": report.when, "outcome": outcome,
            "family": Path(report.nodeid.split("::")[0]).stem.removeprefix("test_"),
            "check": report.nodeid.split("::")[-1].split("[")[0],
            "impl": params.pop("impl", None), "world_size": params.get("world_size"),
            "params": params, "duration_s": round(report.duration, 4),
            "message": report.longreprtext if outcome in ("failed", "error", "skipped", "unsupported",
                                                          "xfailed") else "",
            "rank_outcomes": _jsonable(props.get("rank_outcomes", {})),
            "max_abs_err": max((e["max_abs"] for e in errors), default=None),
            "max_rel_err": max((e["max_rel"] for e in errors), default=None),
            "tolerances": sorted({(e["rtol"], e["atol"]) for e in errors if e["rtol"] is not None}),
            "expectation": _jsonable(props.get("expectation")),
        }
        with self.lines.open("a") as f:
            f.write(json.dumps(cell) + "\n")

    def pytest_sessionfinish(self, session):
        report = assemble(self.lines, complete=True)
        self.path.write_text(json.dumps(report, indent=1) + "\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    params = dict(getattr(item, "callspec", None).params) if hasattr(item, "callspec") else {}
    if "impl" in params:
        params["impl"] = params["impl"].name
    params.pop("shardcheck_backend", None)
    rep._shardcheck_params = params


def assemble(lines: Path, complete: bool = False) -> dict:
    header, cells = {}, {}
    for line in lines.read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            complete = False  # a line cut short by a crash
            continue
        if entry.pop("kind") == "header":
            header = entry
        else:
            prev = cells.get(entry["nodeid"])
            if prev is None or prev["outcome"] == "passed":  # a teardown error overrides a pass
                cells[entry["nodeid"]] = entry
    finished = dt.datetime.now(dt.timezone.utc)
    started = dt.datetime.fromisoformat(header.get("started", finished.isoformat()))
    summary: dict = {"by_outcome": {}, "by_family": {}}
    for cell in cells.values():
        summary["by_outcome"][cell["outcome"]] = summary["by_outcome"].get(cell["outcome"], 0) + 1
        fam = summary["by_family"].setdefault(cell["family"], {})
        fam[cell["outcome"]] = fam.get(cell["outcome"], 0) + 1
    return {**header, "finished": finished.isoformat(), "duration_s": (finished - started).total_seconds(),
            "complete": complete, "summary": summary, "cells": list(cells.values())}


def _git_revision() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, text=True,
                              capture_output=True, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _target(config) -> dict:
    cuda = torch.cuda.is_available()
    return {
        "backends": getattr(config, "_shardcheck_backends", None),
        "device_type": "cuda" if cuda and "nccl" in (getattr(config, "_shardcheck_backends", []) or [])
        else "cpu",
        "device_model": torch.cuda.get_device_name(0) if cuda else platform.processor() or platform.machine(),
        "world_sizes": sorted(getattr(config, "_shardcheck_sizes", None) or []) or "all",
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
        "python": sys.version.split()[0], "platform": platform.platform(),
        "env": {k: os.environ[k] for k in RECORDED_ENV if k in os.environ},
    }


def pytest_configure(config):
    path = config.getoption("shardcheck_report")
    if path and not hasattr(config, "workerinput"):
        config.pluginmanager.register(ReportWriter(config, Path(path)), "shardcheck-report-writer")
