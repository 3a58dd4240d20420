"""pytest plugin (registered by the selection plugin when `--shardcheck-split K/N` is given): the
session runs part K of N of the cells it selected (shardcheck.conformance.report.split).

The split is made last, after every other deselection (-k, --shardcheck-world-sizes), over the
cells left: every part of one command line splits the same cells. The durations it balances come
from the reports `--shardcheck-durations PATH` names (repeatable), else from the committed reports
(reports/*.json where the session starts) of the implementations checked; without any, it splits by
count. Under pytest-xdist every worker makes the same split, and the first to finish sends it to the
controller, whose report writer records it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from shardcheck.conformance.report import split
from shardcheck.conformance.report.cells import nodeid_of


def durations(config, items) -> dict[str, float]:
    from shardcheck.conformance.report.reading import ReportError, load

    paths = config.getoption("shardcheck_durations")
    if paths:
        try:
            return split.durations_of([load(path) for path in paths])
        except ReportError as exc:
            raise pytest.UsageError(f"--shardcheck-durations: {exc}") from None
    impls = set()
    if any("impl" in getattr(getattr(item, "callspec", None), "params", {}) for item in items):
        from shardcheck.conformance.plugins import selection

        impls = set(selection.impls(config))
    return split.durations_of(split.default_reports(Path(config.invocation_params.dir), impls)) if impls else {}


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    wanted: split.Split | None = config.getoption("shardcheck_split")
    if wanted is None:
        return
    keys = [split.key(nodeid_of(item)) for item in items]
    timed = durations(config, items)
    parts = split.plan(keys, timed, wanted.of)
    made = split.record(wanted, keys, parts, timed)
    config.stash[split.RECORD] = made
    if hasattr(config, "workeroutput"):  # a pytest-xdist worker: the controller writes the report
        config.workeroutput[split.WORKER_OUTPUT] = made
    kept = [item for item, part in zip(items, parts) if part == wanted.part]
    dropped = [item for item, part in zip(items, parts) if part != wanted.part]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def pytest_report_header(config):
    wanted = config.getoption("shardcheck_split")
    return [f"shardcheck split: part {wanted} of the selected cells"] if wanted else None
