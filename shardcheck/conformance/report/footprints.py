"""Memory per rank against world size, from the family sharding's cells (their `footprint`, report
version 5): for each implementation and strategy, what a rank holds between steps as a share of
what unsharded training holds, at each world size, beside 1/n, the share perfect sharding reaches
(2/n for HYBRID_SHARD's two replicas; none for NO_SHARD, nor for SHARD_OPTIMIZER, whose saving is the
optimizer's share of what is held: the chart shows its measured line alone).

    share(impl, strategy, n) = footprint.rest.measured / footprint.rest.unsharded

`table(cells)` gives the numbers (the Markdown matrix prints them), `chart_svg(cells)` the picture
(matplotlib, the extra `chart`): one panel per strategy, a line per implementation.
"""

from __future__ import annotations

import io
from collections import defaultdict

from shardcheck.conformance.report.reading import Cell
from shardcheck.strategy import Strategy

STRATEGIES = (Strategy.FULL_SHARD, Strategy.SHARD_GRAD_OP, Strategy.HYBRID_SHARD, Strategy.SHARD_OPTIMIZER, Strategy.NO_SHARD)


def table(cells: dict[tuple[str, str], Cell]) -> dict[str, dict[str, dict[int, float]]]:
    """{strategy: {implementation column: {world size: held share}}} of the cells with a footprint."""
    out: dict = defaultdict(lambda: defaultdict(dict))
    for (column, _), cell in cells.items():
        figures = cell.get("footprint")
        if not figures or not figures.get("rest", {}).get("unsharded"):
            continue
        held = figures["rest"]["measured"] / figures["rest"]["unsharded"]
        out[figures["strategy"]][column][int(cell["world_size"])] = round(held, 3)
    return {s: dict(out[s]) for s in STRATEGIES if s in out}


def markdown(cells: dict[tuple[str, str], dict], chart: str | None = None) -> list[str]:
    """The Markdown lines of the section: the picture (when `chart` names it) and the table."""
    shares = table(cells)
    if not shares:
        return []
    sizes = sorted({n for by_impl in shares.values() for per in by_impl.values() for n in per})
    out = ["", "### Memory per rank (family sharding)", "",
           "Held between steps, as a share of what unsharded data-parallel training holds (1/n: perfect "
           "sharding over n ranks; measured by the suite at the allocations).", ""]
    if chart:
        out += [f"![memory per rank against world size]({chart})", ""]
    out += ["| strategy | implementation | " + " | ".join(f"ws{n}" for n in sizes) + " |",
            "|---|---|" + "---|" * len(sizes)]
    for strategy, by_impl in shares.items():
        for column, per in sorted(by_impl.items()):
            out.append(f"| {strategy} | {column} | " + " | ".join(
                f"{per[n]:.2f}" if n in per else "–" for n in sizes) + " |")
    return out


IDEAL = {Strategy.FULL_SHARD: lambda n: 1 / n, Strategy.SHARD_GRAD_OP: lambda n: 1 / n,
         Strategy.HYBRID_SHARD: lambda n: 2 / n}  # (replicate 2, shard n/2); NO_SHARD promises no saving
TOP = 2.0  # the chart's highest share; a larger one is drawn at the top, its value written beside it


def chart_svg(cells: dict[tuple[str, str], Cell], image_format: str = "svg"):
    """One panel per strategy: held share against world size, a line per implementation, 1/n dashed
    (an SVG string; `image_format="png"`: PNG bytes)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    shares = table(cells)
    columns = sorted({column for by_impl in shares.values() for column in by_impl})
    palette = matplotlib.colormaps["tab20"].colors
    colors = {column: palette[i % len(palette)] for i, column in enumerate(columns)}  # one per implementation
    fig = Figure(figsize=(3.2 * max(1, len(shares)), 3.4), dpi=100)
    axes = fig.subplots(1, max(1, len(shares)), sharey=True, squeeze=False)[0]
    for ax, (strategy, by_impl) in zip(axes, shares.items()):
        sizes = sorted({n for per in by_impl.values() for n in per})
        if strategy in IDEAL:
            ax.plot(sizes, [IDEAL[strategy](n) for n in sizes], "k--", linewidth=1, label="perfect sharding")
        for column, per in sorted(by_impl.items()):
            ns = sorted(per)
            line, = ax.plot(ns, [min(per[n], TOP) for n in ns], marker="o", linewidth=1.2, label=column,
                            color=colors[column])
            for n in ns:
                if per[n] > TOP:
                    ax.annotate(f"{per[n]:.3g}x", (n, TOP), fontsize=6, color=line.get_color(),
                                xytext=(3, -8), textcoords="offset points")
        ax.set_title(strategy, fontsize=9)
        ax.set_xticks(sizes)
        ax.set_xlabel("world size", fontsize=8)
        ax.set_yscale("log", base=2)
        ax.set_ylim(top=TOP * 1.1)
        ax.tick_params(labelsize=7)
        ax.spines[["top", "right"]].set_visible(False)
    axes[0].set_ylabel("held per rank / unsharded", fontsize=8)
    found = {label: handle for ax in axes for handle, label in zip(*ax.get_legend_handles_labels())}
    handles, labels = list(found.values()), list(found)
    fig.legend(handles, labels, fontsize=7, loc="upper center", ncol=min(6, len(labels)), frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.82))
    if image_format == "png":
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png")
        return buffer.getvalue()
    buffer = io.StringIO()
    fig.savefig(buffer, format="svg", metadata={"Date": None})
    return buffer.getvalue()
