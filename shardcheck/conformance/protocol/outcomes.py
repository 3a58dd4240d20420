"""The outcome of a cell, one vocabulary for the plugin, the report, the progress display and the
matrix; and `Unsupported`, the outcome's exception.

    passed      the implementation did what the check states
    failed      it did not (or an expectation-listed cell passed: strict xfail)
    error       the cell could not be set up or torn down
    xfailed     a known failure listed in the implementation's expectations manifest
    xpassed     (not produced: manifests are strict, a passing known failure fails)
    unsupported the cell needs a capability the implementation does not declare: never a pass
    skipped     the machine cannot run the cell (backend, devices): never a pass either
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pytest import TestReport



class Outcome(enum.StrEnum):
    """A cell's outcome (the module doc says each); a `str`, equal to its value, written as it."""
    PASSED = "passed"
    FAILED = "failed"
    ERROR = "error"
    XFAILED = "xfailed"
    XPASSED = "xpassed"
    UNSUPPORTED = "unsupported"
    SKIPPED = "skipped"

    __repr__ = str.__repr__  # 'passed', as the strings printed before


# The functions below return plain strings (what crosses to an xdist controller must: execnet
# serializes no enum); these tuples hold members, which compare equal to those strings.
OUTCOMES = tuple(Outcome)
BAD = (Outcome.FAILED, Outcome.ERROR)                 # what makes a run fail
GOOD = (Outcome.PASSED, Outcome.XPASSED)              # the implementation did what the check states
NOT_REACHED = (Outcome.UNSUPPORTED, Outcome.SKIPPED)  # left out of conformance, counted against coverage
REACHED = tuple(o for o in OUTCOMES if o not in NOT_REACHED)  # cells that reached a verdict

_PREFIX = "unsupported:"
PROPERTY = "shardcheck_outcome"  # the user property that carries a cell's outcome through xdist
MISSING_PROPERTY = "missing_capabilities"  # {capability: why not} of the capabilities an unsupported cell needed


class Unsupported(pytest.skip.Exception):  # type: ignore[name-defined,misc]  # pytest's Skipped, as pytest names it
    """Raised by an adapter or a check when a cell needs a feature the implementation lacks.

    It travels like a skip (also from rank processes, where only its message survives), and the
    plugin turns it into the outcome `unsupported`."""

    def __init__(self, msg: str) -> None:
        super().__init__(f"{_PREFIX} {msg}")
        self.reason = msg


def is_unsupported_message(text: str) -> bool:
    """Whether a skip's text came from `Unsupported` (the form in which it crosses processes)."""
    return _PREFIX in text


def reason_of(report: TestReport) -> str:
    """Why a cell did not reach a verdict: its skip's text, without pytest's and Unsupported's prefixes."""
    text = str(report.longrepr[2]) if isinstance(report.longrepr, tuple) else str(report.longrepr or "")
    return text.removeprefix("Skipped: ").removeprefix(_PREFIX).strip()


def outcome_of(report: TestReport) -> str | None:
    """The cell's outcome that a pytest phase report decides, or None (a passed setup/teardown)."""
    marked = dict(getattr(report, "user_properties", ())).get(PROPERTY)
    if marked:
        return str(marked)
    if hasattr(report, "wasxfail"):
        return "xfailed" if report.skipped else "xpassed"
    if report.outcome == "skipped":
        return "unsupported" if is_unsupported_message(str(report.longrepr)) else "skipped"
    if report.when == "call":
        return str(report.outcome)
    if report.outcome == "failed":
        return "error"
    return None
