"""The trend across releases (of torch, or of an engine): what each release broke and fixed.

Reports of the same implementation made on several releases of torch or of the engine (``shardcheck releases`` writes
them under reports/releases/) are compared cell by cell:

- **counts over a frozen set**: for each implementation, only the cells every release collected
  count in the per-release outcome counts; cells that only some releases collected (a check added
  since, a cell an old release cannot express) are counted apart, so a release never looks better
  or worse because it ran other cells;
- **findings by release**: for each finding (a manifest entry an xfailed cell matched), its cells'
  state on each release: ``known`` (xfailed: the manifest scopes it to that release and it
  reproduced), ``FAILS`` (the same cells fail unscoped: a bug still present outside its scope),
  ``passes`` (every reached cell passed: not present there), ``–`` (not reached); then the first
  release where it is broken and the first later release where it passes.

A release is the torch release (``target.torch`` without the local build tag: ``2.9.1+cu128`` and
``2.9.1+cpu`` are one release) and, for an implementation that has releases of its own (Accelerate,
Lightning, DeepSpeed), its version: the trend follows whichever of the two varies.
"""

from __future__ import annotations

from collections import Counter, defaultdict

from packaging.version import InvalidVersion, Version

from shardcheck.conformance.protocol.outcomes import BAD, NOT_REACHED, OUTCOMES
from shardcheck.conformance.report.reading import Cell

KNOWN, FAILS, PASSES, ABSENT = "known", "FAILS", "passes", "–"


def release(report: dict, impl: str) -> tuple[str, str]:
    """(torch release, the implementation's own release) a report's cells of `impl` were made on:
    versions without their local build tag; the own release is "" where it is torch's (FSDP, DDP)."""
    torch_release = report["target"]["torch"].split("+")[0]
    own = next((i["version"] for i in report["implementations"] if i["name"] == impl), "") or ""
    own = own.split("+")[0]
    return torch_release, "" if own == torch_release else own


def label(rel: tuple[str, str], varies: tuple[bool, bool]) -> str:
    """A release as shown: "torch 2.9.1", "1.13.0" or both, by which of the two vary."""
    parts = [f"torch {rel[0]}"] * varies[0] + [rel[1]] * (varies[1] and bool(rel[1]))
    return ", ".join(parts) or f"torch {rel[0]}"


def _key(rel: tuple[str, str]):
    try:
        return Version(rel[0]), Version(rel[1] or "0")
    except InvalidVersion:
        return Version("0"), Version("0")


def by_release(cells: dict[tuple[str, str], Cell], columns: dict[str, tuple[str, tuple[str, str]]]
               ) -> dict[str, dict[str, dict[str, Cell]]]:
    """{impl: {release label: {cell id: cell}}}, releases in version order (torch's, then the
    implementation's own), from the merged matrix cells and each column's (implementation, release)."""
    grouped: dict[str, dict[tuple[str, str], dict[str, Cell]]] = defaultdict(lambda: defaultdict(dict))
    for (column, cid), cell in cells.items():
        impl, rel = columns[column]
        grouped[impl][rel][cid] = cell
    out = {}
    for impl, rels in grouped.items():
        varies = (len({r[0] for r in rels}) > 1, len({r[1] for r in rels}) > 1)
        out[impl] = {label(rel, varies): rels[rel] for rel in sorted(rels, key=_key)}
    return out


def spans_releases(trend: dict) -> bool:
    return any(len(rels) > 1 for rels in trend.values())


def frozen(rels: dict[str, dict[str, Cell]]) -> set[str]:
    """The cell ids every release of one implementation collected."""
    sets = [set(cells) for cells in rels.values()]
    return set.intersection(*sets) if sets else set()


def counts(rels: dict[str, dict[str, Cell]]) -> dict[str, tuple[Counter, int]]:
    """{release: (outcome counts over the frozen cells, cells outside them)}."""
    keep = frozen(rels)
    return {rel: (Counter(c["outcome"] for cid, c in cells.items() if cid in keep), len(set(cells) - keep))
            for rel, cells in rels.items()}


def state(cells: dict[str, Cell], ids: set[str], finding: str) -> str:
    """One finding's state on one release, from its cells there (see the module docstring)."""
    mine = [cells[cid] for cid in ids if cid in cells]
    if any(c["outcome"] == "xfailed" and (c.get("expectation") or {}).get("finding") == finding for c in mine):
        return KNOWN
    if any(c["outcome"] in BAD for c in mine):
        return FAILS
    if any(c["outcome"] not in NOT_REACHED for c in mine):
        return PASSES
    return ABSENT


def findings(rels: dict[str, dict[str, Cell]]) -> dict[str, dict[str, str]]:
    """{finding: {release: state}} for one implementation; a finding's cells are those xfailed with
    it on any release."""
    ids: dict[str, set[str]] = defaultdict(set)
    for cells in rels.values():
        for cid, c in cells.items():
            finding = (c.get("expectation") or {}).get("finding")
            if c["outcome"] == "xfailed" and finding:
                ids[finding].add(cid)
    order = sorted(ids, key=lambda f: (int("".join(ch for ch in f if ch.isdigit()) or 0), f))
    return {f: {rel: state(cells, ids[f], f) for rel, cells in rels.items()} for f in order}


def first_broken_and_fixed(states: dict[str, str]) -> tuple[str, str]:
    """The first release where the finding is broken (known or failing; "≤ R" when R is the oldest
    release compared: it may have been broken before), and the first later release where it passes;
    "–" for either that never happened."""
    broken = fixed = ABSENT
    oldest = next(iter(states), None)
    for rel, s in states.items():
        if s in (KNOWN, FAILS) and broken == ABSENT:
            broken = rel
        elif s == PASSES and broken != ABSENT and fixed == ABSENT:
            fixed = rel
        elif s in (KNOWN, FAILS):
            fixed = ABSENT  # broken again after a fix: the later fix counts
    return (f"≤ {broken}" if broken == oldest else broken), fixed


def _describe(counter: Counter) -> str:
    return ", ".join(f"{counter[o]} {o}" for o in OUTCOMES if counter[o]) or "–"


def markdown(trend: dict) -> list[str]:
    """The "Across releases" section: outcome counts per implementation x release over the
    frozen cells, then each finding's state per release."""
    out = ["", "### Across releases", "",
           "Outcome counts over the cells every release of that implementation collected; "
           "`+N` cells that only that release collected, counted apart.", ""]
    for impl, rels in trend.items():
        if len(rels) < 2:
            continue
        per = counts(rels)
        out += [f"#### {impl} · {len(frozen(rels))} cells on every release", "",
                "| release | outcomes | apart |", "|---|---|---|"]
        out += [f"| {rel} | {_describe(c)} | {f'+{extra}' if extra else ''} |" for rel, (c, extra) in per.items()]
        table = findings(rels)
        if table:
            out += ["", "| finding | " + " | ".join(rels) + " | first broken | first fixed |",
                    "|---" * (len(rels) + 3) + "|"]
            for finding, states in table.items():
                out.append(f"| {finding} | " + " | ".join(states.values()) + " | "
                           + " | ".join(first_broken_and_fixed(states)) + " |")
        out.append("")
    out.append(f"`{KNOWN}`: xfailed as the manifest expects; `{FAILS}`: its cells fail outside the manifest's "
               f"scope; `{PASSES}`: every reached cell passed; `{ABSENT}`: not reached.")
    return out
