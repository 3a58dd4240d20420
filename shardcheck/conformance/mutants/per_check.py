"""pytest plugin for mutant runs: once a cell of a check function FAILED, the function's remaining
cells are skipped ("already killed"), so that every listed check function gets to show its kill in
one pytest process without running all of its cells. Loaded with ``-p shardcheck.conformance.mutants.per_check``
by tests/conformance/test_mutants.py."""

from __future__ import annotations

import pytest

_KILLED: set[tuple[str, str]] = set()


def _key(item) -> tuple[str, str]:
    return (str(item.path), getattr(item, "originalname", item.name))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    if _key(item) in _KILLED:
        pytest.skip("check function already killed the mutant")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and report.when == "call":
        _KILLED.add(_key(item))
