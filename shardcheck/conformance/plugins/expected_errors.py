"""A known failure must be the known one: an expectations-manifest entry names the error its cells
fail with (`error`, a regex: shardcheck/conformance/expectations/manifest.py), and a cell it marks that fails
otherwise is reported failed, not xfailed.

pytest's strict xfail (what selection.py makes of an entry) excuses any failure of the cell. This
plugin, registered by selection.py, wraps pytest's own report hook: when a cell marked by an entry
comes out xfailed, the entry's regex is searched (re.search) in the cell's failure text, the text
the run prints and the report keeps (for a distributed cell, the ranks' verdict: headline and rank
blocks). No match: the report becomes a failure whose text starts with one line naming the entry
(manifest, finding, regex) and the actual failure's first line, then the original failure text
whole. A cell that passes is left to pytest (strict: XPASS fails), and so is an entry without
`error` (the manifest loader says which may leave it out).
"""

from __future__ import annotations

import os

import pytest

from shardcheck.conformance.report.texts import without_worker_line

ENTRY = pytest.StashKey[dict]()  # the manifest entry that marked the item (selection.py sets it)
FIRST_LINE_LIMIT = 300  # characters of the actual failure's first line in the headline


def expect(item, entry: dict) -> None:
    """Remember on `item` the manifest entry whose failure it is expected to show."""
    item.stash[ENTRY] = entry


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    """Outermost around pytest's skipping plugin, so the report is already xfailed when it comes back."""
    report = yield
    entry = item.stash.get(ENTRY, None)
    if entry is not None and _expected_failure(report, call):
        text = without_worker_line(report.longreprtext)
        if "_error" in entry and not entry["_error"].search(text):
            _refuse(report, entry, headline(entry, _first_line(call, text)), text)
    return report


def _expected_failure(report, call) -> bool:
    """Whether pytest turned this phase's exception into an xfail (not an imperative pytest.xfail)."""
    return (hasattr(report, "wasxfail") and report.skipped and call.excinfo is not None
            and not isinstance(call.excinfo.value, pytest.xfail.Exception))


def _refuse(report, entry: dict, head: str, text: str) -> None:
    """Turn the xfailed report into a failure that says why, keeping the original failure text."""
    del report.wasxfail
    report.outcome = "failed"
    report.longrepr = f"{head}\n\n{text}"


def headline(entry: dict, actual: str) -> str:
    """One line: the entry (manifest, finding, regex) and the failure the cell showed instead."""
    finding = f" ({entry['finding']})" if entry.get("finding") else ""
    return (f"expectation {_shown_path(entry['_path'])}{finding} expects an error matching "
            f"{entry['error']!r}; the cell failed with: {actual}")


def _shown_path(path: str) -> str:
    """The manifest's path relative to the working directory when it lies below it."""
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


def _first_line(call, text: str) -> str:
    """The actual failure's first line: the exception's message (pytest.fail's text as given, the
    ranks' verdict headline), else the failure text's first non-empty line; bounded."""
    exc = call.excinfo.value
    message = str(exc) if isinstance(exc, pytest.fail.Exception) else call.excinfo.exconly()
    lines = [line for line in (message or text).splitlines() if line.strip()] or [""]
    line = lines[0].strip()
    return line if len(line) <= FIRST_LINE_LIMIT else line[:FIRST_LINE_LIMIT] + " ..."
