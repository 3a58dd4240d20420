"""What kind of known failure an expectations-manifest entry (and its FINDINGS.md finding) is: the
verdict an engine's maintainers would sign (docs/findings.md).

    bug         breaks the mathematics of data parallelism, or the engine's own documented promise
    by design   the engine documents other behaviour: the entry's `document` cites where (a URL);
                the cell is judged against a convention the engine never promised (DDP's buffer
                broadcast, for one) and says "differs from ..., by design (document)"
    platform    only on the CPU stand-in: a shim, a CPU-only code path, a configuration the repro
                forces that a GPU user does not meet
    misuse      a variant that shows what a user meets when they use the engine against its docs

Conformance counts bugs only (shardcheck/conformance/report/coverage.py): a cell whose known failure is
by design, platform or misuse is set aside, neither passed nor failed, and listed apart by kind.

Only the standard library here: the matrix reads kinds without torch. `of_findings` reads the
built-in manifests (this folder); an entry of another manifest, or a cell without a finding, counts
as a bug (the conservative verdict)."""

from __future__ import annotations

import re
import tomllib
from functools import cache
from pathlib import Path

HERE = Path(__file__).parent
BUG, BY_DESIGN, PLATFORM, MISUSE = "bug", "by design", "platform", "misuse"
KINDS = (BUG, BY_DESIGN, PLATFORM, MISUSE)
URL = re.compile(r"https?://\S+$")


def problem(entry: dict) -> str | None:
    """Why an entry's `kind` (and `document`) is not valid, or None. `document` is required for
    `by design` (where the engine documents the behaviour) and allowed for the others (a link to the
    platform's or the misuse's documentation)."""
    kind = entry.get("kind")
    if kind not in KINDS:
        return f"kind = {kind!r} is not one of {', '.join(repr(k) for k in KINDS)}"
    document = entry.get("document")
    if document is None and kind == BY_DESIGN:
        return "a 'by design' entry needs document = the URL where the engine documents the behaviour"
    if document is not None and (not isinstance(document, str) or not URL.match(document)):
        return f"document = {document!r} is not a URL"
    return None


@cache
def of_findings() -> dict[str, tuple[str, str | None, str | None]]:
    """{finding: (kind, document, convention)} over the built-in manifests' xfail and explore entries; an entry
    without a finding is not listed. Where entries of one finding disagree the first (by manifest
    name) wins here; tests/conformance/test_findings_kinds.py refuses such manifests."""
    out: dict[str, tuple[str, str | None, str | None]] = {}
    for path in sorted(HERE.glob("*.toml")):
        tables = tomllib.loads(path.read_text())
        for entry in tables.get("xfail", []) + tables.get("explore", []):
            if "finding" in entry and entry.get("kind") in KINDS:
                out.setdefault(entry["finding"], (entry["kind"], entry.get("document"), entry.get("convention")))
    return out


def of_expectation(expectation: dict | None) -> tuple[str, str | None, str | None]:
    """(kind, document, convention) of an xfailed cell's expectation (a report's `expectation`:
    reason, repro, finding), from the entry itself where it carries a kind, else from its finding's
    entries (reports keep no kind: it is judged now, from the manifests); a bug otherwise."""
    expectation = expectation or {}
    if expectation.get("kind") in KINDS:
        return expectation["kind"], expectation.get("document"), expectation.get("convention")
    return of_findings().get(expectation.get("finding") or "", (BUG, None, None))


def of_cell(cell: dict) -> str | None:
    """The kind of a cell's known failure: None unless the cell is xfailed."""
    if cell.get("outcome") != "xfailed":
        return None
    return of_expectation(cell.get("expectation"))[0]


def label(kind: str, document: str | None, convention: str | None = None) -> str:
    """How a matrix names a group of known failures: "bug", "platform", "misuse", or "by design
    (document)"; a cell judged against another engine's convention: "differs from DDP, by design (...)"."""
    if kind != BY_DESIGN:
        return kind
    where = f" ({document})" if document else ""
    return f"differs from {convention}, by design{where}" if convention else f"by design{where}"
