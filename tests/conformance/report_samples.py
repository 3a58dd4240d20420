"""Hand-made reports for the report tests: cells, a report of them (schema-valid), written as any
schema version, and two runs of two implementations."""

import json

from shardcheck.conformance.report import reading
from shardcheck.conformance.report import writer as reporting


def cell(impl, check, outcome, family="clip_grad", params="ws2-FULL_SHARD", message=""):
    return {"nodeid": f"shardcheck/conformance/checks/test_{family}.py::{check}[{impl}-{params}]", "phase": "call",
            "outcome": outcome, "family": family, "check": check, "impl": impl, "world_size": 2,
            "params": {"world_size": 2}, "duration_s": 0.01, "message": message,
            "rank_outcomes": {"0": "passed", "1": "passed"}, "max_abs_err": 0.0, "max_rel_err": None,
            "tolerances": [[1.3e-06, 1e-05]], "expectation": None}


def report(cells, backends=("gloo",), day=1):
    """A small hand-made report, schema-valid (test_reports.py::test_hand_made_reports_are_valid checks it), run on
    January `day`."""
    impls = sorted({c["impl"] for c in cells})
    return {"schema_version": 1, "suite": {"name": "shardcheck", "version": "0.1.0", "git_revision": None},
            "started": f"2026-01-{day:02d}T00:00:00+00:00", "finished": f"2026-01-{day:02d}T00:00:01+00:00",
            "duration_s": 1.0, "complete": True, "exit_status": 0,
            "implementations": [{"name": i, "selected_as": i, "version": "1", "adapter": "m:A",
                                 "capabilities": []} for i in impls],
            "target": {"backends": list(backends), "device_type": "cpu", "device_model": "x86_64",
                       "world_sizes": "all", "torch": "2.13.0+cpu", "cuda": None, "nccl": None,
                       "python": "3.11.7", "platform": "Linux", "env": {}},
            "summary": {"by_outcome": {}, "by_family": {}}, "cells": cells}


def write(tmp_path, name, report, version=1):
    """`report` (version 1) written as `version`: 2 upgraded, 7 as the writer writes it, 6 to 3 as
    they did (6: the same without a split; 5: less the target's unjudged line; 4: less the rows' last
    column, footprint too; 3: less max_margin too)."""
    path = tmp_path / name
    if version >= 3:
        reporting.write(reporting.rewrite(reading.upgrade(report), None), path)
        if version < 7:
            old = json.loads(path.read_text())
            columns = {6: 14, 5: 14, 4: 13, 3: 12}[version]
            old["schema_version"], old["cell_columns"] = version, old["cell_columns"][:columns]
            old["cells"] = [row[:columns] for row in old["cells"]]
            if version < 6:
                old["target"].pop("unjudged", None)
            path.write_text(json.dumps(old))
    else:
        path.write_text(json.dumps(reading.upgrade(report) if version == 2 else report))
    return str(path)


def two_runs(tmp_path, version=1):
    ref = report([cell("reference", f"test_c{i}", "passed") for i in range(4)]
                  + [cell("reference", "test_h", "passed", family="comm_hooks")])
    fsdp = report([cell("torch-fsdp2", "test_c0", "passed"), cell("torch-fsdp2", "test_c1", "xfailed"),
                    cell("torch-fsdp2", "test_c2", "unsupported"), cell("torch-fsdp2", "test_c3", "skipped"),
                    cell("torch-fsdp2", "test_h", "failed", family="comm_hooks",
                          message="def test_h(ctx):\n>   assert_close(...)\n"
                                  "E   AssertionError: grads: 2 mismatch(es)\nE   more"),
                    cell("torch-fsdp2", "test_h2", "error", family="comm_hooks", message="rank 1 died: SIGSEGV")])
    return write(tmp_path, "ref.json", ref, version), write(tmp_path, "fsdp.json", fsdp, version)
