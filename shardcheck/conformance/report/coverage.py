"""Coverage and conformance per implementation and layer: one computation for the run's summary,
the JSON report's `summary.by_impl` and the matrix.

    collected    cells that finished (any outcome)
    reached      cells that reached a verdict (protocol.outcomes.REACHED): not unsupported, not skipped
    passed       cells that passed
    coverage     reached / collected, in percent: a run that reaches few cells is not green
    conformance  passed / reached, in percent (an xfailed, known failure counts as not passed)

With `bugs_only` (the matrix, the HTML page and `shardcheck run`'s summary) a known failure that is
no bug (its kind, shardcheck/conformance/expectations/kinds.py: by design, platform or misuse) is set
aside, neither passed nor failed, and conformance counts bugs only:

    set_aside    xfailed cells whose known failure is by design, platform or misuse
    judged       reached - set_aside
    conformance  passed / judged, in percent

The JSON report's `summary.by_impl` (schema version 6) keeps the tally without them: passed / reached.
Percentages are None where their denominator is 0.
"""

from __future__ import annotations

from collections.abc import Iterable

from shardcheck.conformance.checks import LAYERS, layer_of_family
from shardcheck.conformance.expectations import kinds
from shardcheck.conformance.protocol.outcomes import REACHED

OTHER = "other"  # the layer of a family in no layer (tests of the suite itself)
ALL = "all"      # every layer together
SET_ASIDE = (kinds.BY_DESIGN, kinds.PLATFORM, kinds.MISUSE)  # known failures conformance does not count


def verdict_of(cell: dict) -> str:
    """The cell's outcome; for a known failure that is no bug, its kind instead (by design, platform,
    misuse). A cell may carry `kind` already (the run's progress display); otherwise it is judged
    from its expectation (shardcheck.conformance.expectations.kinds.of_cell)."""
    kind = cell.get("kind") or kinds.of_cell(cell)
    return kind if kind in SET_ASIDE and cell["outcome"] == "xfailed" else cell["outcome"]


def layer_of(family: str) -> str:
    return layer_of_family(family) or OTHER


def percent(part: int, whole: int) -> float | None:
    return round(100.0 * part / whole, 2) if whole else None


def tally(counts: dict) -> dict:
    """{collected, reached, passed} plus the two percentages; with `set_aside` also `judged`, and
    conformance over the judged cells."""
    if "set_aside" in counts:
        counts = {**counts, "judged": counts["reached"] - counts["set_aside"]}
    return {**counts, "coverage": percent(counts["reached"], counts["collected"]),
            "conformance": percent(counts["passed"], counts.get("judged", counts["reached"]))}


def by_impl(cells: Iterable[dict], bugs_only: bool = False) -> dict[str, dict[str, dict]]:
    """{impl: {layer: tally, ..., "all": tally}} from cells with `impl`, `family` and `outcome`
    (report cells, or the progress display's finished cells). Layers in LAYERS order. `bugs_only`:
    known failures that are no bug are set aside (`verdict_of`), conformance counts bugs only."""
    raw: dict[str, dict[str, dict]] = {}
    order = [*LAYERS, OTHER, ALL]
    for cell in cells:
        impl = cell.get("impl") or "-"
        for layer in (cell.get("layer") or layer_of(cell["family"]), ALL):
            counts = raw.setdefault(impl, {}).setdefault(
                layer, {"collected": 0, "reached": 0, "passed": 0, **({"set_aside": 0} if bugs_only else {})})
            counts["collected"] += 1
            counts["reached"] += cell["outcome"] in REACHED
            counts["passed"] += cell["outcome"] == "passed"
            if bugs_only:
                counts["set_aside"] += verdict_of(cell) in SET_ASIDE
    return {impl: {layer: tally(layers[layer]) for layer in order if layer in layers}
            for impl, layers in raw.items()}


def below(table: dict[str, dict[str, dict]], min_coverage: float) -> list[str]:
    """One line per implementation whose overall coverage is below `min_coverage` percent."""
    lines = []
    for impl, layers in table.items():
        total = layers[ALL]
        if (total["coverage"] or 0.0) < min_coverage:
            lines.append(f"shardcheck: {impl}: coverage {total['coverage'] or 0.0:.1f}% "
                         f"({total['reached']} of {total['collected']} cells reached a verdict) "
                         f"is below --min-coverage {min_coverage:g}%")
    return lines


def show(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}%"
