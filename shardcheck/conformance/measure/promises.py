"""What each sharding strategy promises of a rank's memory and traffic, as bounds computed from the
model's shapes and the unsharded figures (footprint.measure of the yardstick), and the verdict of
one measured footprint against them.

Notation: ``u`` the unsharded figures, ``n`` the shard group size (the world for a 1-D strategy,
the shard dimension of HYBRID_SHARD's (replicate, shard) mesh; 1 for NO_SHARD; the world for
SHARD_OPTIMIZER, whose optimizer state is what is sharded), ``r`` the replicas,
``P`` the parameter bytes, ``s`` the most parameter bytes one rank's shard holds with the padding
its layout needs (`Shapes.shard_bytes`: per parameter, dim 0 padded to a multiple of n, or per
unit, the flat parameter padded to a multiple of n, whichever is larger), ``k = s / P`` (1/n
when every size divides; 1 when nothing is sharded), ``U`` the largest unit's parameters and ``R``
the root's (parameters in no unit), both as gathered (padded), ``C`` a stated constant for
bookkeeping (SMALL bytes):

    row                          applies to                    bound
    held between steps           every cell                    <= F + S * k + C   (F: what the strategy
                                                                  keeps whole, S: what it shards, of
                                                                  u.held + u.gradients; below)
    parameters held between steps every cell                   <= u.parameters * k + C  (the `nn.Parameter`
                                                                  storages; SHARD_GRAD_OP, SHARD_OPTIMIZER:
                                                                  u.parameters + C)
    optimizer state              every cell                    <= u.optimizer * k + C
    gradients after backward     every cell                    <= u.gradients * k + C  (`.grad` and the
                                                                  engine's own buffers born in the step;
                                                                  SHARD_OPTIMIZER: u.gradients + C)
    held after backward          every cell                    <= u.gradients * k + C  (growth over the
                                                                  backward: gradients and leftovers;
                                                                  SHARD_OPTIMIZER: u.gradients + C)
    kept gathered after forward  FULL_SHARD, HYBRID_SHARD      <= R + U + C  (gathered in forward, alive
                                                                  at its end: the root, one unit at most)
    gathered at any moment       every cell                    FULL_SHARD, HYBRID_SHARD: <= R + 3U + C
                                                                  (the unit in use, one prefetched, one
                                                                  all-gather buffer being copied out);
                                                                  SHARD_GRAD_OP: <= P*n*k + 2U + C (all
                                                                  units, kept until backward);
                                                                  SHARD_OPTIMIZER: <= P*n*k + C (the
                                                                  parameters, if an all-gather
                                                                  redistributed them); NO_SHARD and one
                                                                  rank: <= C (nothing to gather)
    peak during the step         every cell                    sharded: <= u.forward + gathered bound
                                                                  + 2U (a unit's unsharded gradients and
                                                                  their reduce buffer) + u.gradients * k
                                                                  + C; NO_SHARD, SHARD_OPTIMIZER and one
                                                                  rank: <= PEAK_OF_UNSHARDED * u.peak + C
    bytes sent, per kind         every cell                    within [LOW * f(P), HIGH * f(n*s)] + SMALL
                                                                  for each collective kind (all-gather,
                                                                  reduce-scatter, all-reduce); any other
                                                                  kind <= SMALL

F and S by strategy: FULL_SHARD and HYBRID_SHARD shard everything (F = 0); SHARD_GRAD_OP keeps the
parameters whole between steps (ZeRO-2; FSDP's SHARD_GRAD_OP frees them, which also passes) and
shards the rest; NO_SHARD shards nothing (k = 1); SHARD_OPTIMIZER (ZeRO-1) keeps the parameters and
gradients whole and shards the optimizer state (F = everything but u.optimizer, S = u.optimizer).
An engine may keep its gradients between steps (FSDP1 frees them at the next forward), sharded like
the rest.

The traffic formulas f per kind, in a ring (traffic.Collective.sent):

    strategy        all_gather              reduce_scatter     all_reduce
    FULL_SHARD      (2P - R) (n-1)/n        P (n-1)/n          0
    HYBRID_SHARD    (2P - R) (n-1)/n        P (n-1)/n          2 (P/n) (r-1)/r   (across replicas)
    SHARD_GRAD_OP   P (n-1)/n               P (n-1)/n          0
    NO_SHARD        0                       0                  2 P (r-1)/r
    SHARD_OPTIMIZER P (n-1)/n               0                  2 P (n-1)/n

SHARD_OPTIMIZER all-reduces the gradients and then redistributes the parameters each rank updated:
by all-gather (DeepSpeed) or by one broadcast from each rank of what it owns (the reference, torch's
ZeroRedundancyOptimizer): its all_gather row counts both kinds.

FULL_SHARD gathers each unit in forward and again in backward (the root may stay gathered: FSDP2
does not reshard it after forward). The window's low end is LOW times f of the unpadded P with the
root kept, its high end HIGH times f of the padded model (n * s) with the root re-gathered. LOW = 0.9 leaves room for an engine that skips the backward
re-gather of the one unit whose backward needs no parameter (the first, when the input needs no
gradient): one of the eight units of the family's model. A doubled gather, an all-reduce in place
of a reduce-scatter, a missing backward re-gather each fall outside.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from shardcheck.strategy import Strategy

SMALL = 4096            # bytes: bookkeeping, scalars (a loss, a norm, a found-inf flag), alignment
LOW, HIGH = 0.9, 1.1    # sent / formula, per collective kind
PEAK_OF_UNSHARDED = 1.05  # NO_SHARD and one rank: the peak of unsharded training, within 5%
PREFETCHED = 3          # FULL_SHARD: units gathered at once (in use, prefetched, a buffer being copied out)
IN_FLIGHT = 2           # units of unsharded gradients alive at once (a unit's, and its reduce buffer)
SHARDED = (Strategy.FULL_SHARD, Strategy.SHARD_GRAD_OP, Strategy.HYBRID_SHARD)
OPTIMIZER_ONLY = Strategy.SHARD_OPTIMIZER  # ZeRO-1: the optimizer state sharded, nothing else
REDISTRIBUTION = ("all_gather", "broadcast")  # SHARD_OPTIMIZER's parameter redistribution, either kind
RESHARDS_AFTER_FORWARD = (Strategy.FULL_SHARD, Strategy.HYBRID_SHARD)
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")


@dataclass(frozen=True)
class Shapes:
    """What the bounds are computed from: the model's parameter bytes, by unit, on `n` shards. The
    padded figures are what a gathered unit or the gathered model occupies: n times the most one rank
    holds of it (module doc)."""

    parameter_bytes: int      # P
    root_bytes: int           # parameters in no unit (the root's), unpadded: what stays gathered on the wire
    gathered_root_bytes: int  # R: the root's, as gathered (padded)
    largest_unit_bytes: int   # U, as gathered (padded; the root counts as a unit)
    shard_bytes: int          # s: the most parameter bytes one rank holds, padding included

    @classmethod
    def of(cls, model, units: tuple[str, ...], n: int) -> "Shapes":
        """From `model`'s parameters (any device, meta included), `units` the names of its
        sharded submodules (the root owns the rest), sharded over `n` ranks."""
        owner: dict[int, str] = {}
        for unit in sorted(units, key=len):  # a nested unit takes its own parameters from its parent
            for p in model.get_submodule(unit).parameters():
                owner[id(p)] = unit
        groups: dict[str, list] = {}
        for p in model.parameters():
            groups.setdefault(owner.get(id(p), ""), []).append(p)
        shard = {u: _shard_bytes(ps, n) for u, ps in groups.items()}
        per_param = sum(_row_padded(p, n) for ps in groups.values() for p in ps)
        flat = sum(math.ceil(sum(p.numel() for p in ps) / n) * ps[0].element_size() for ps in groups.values())
        return cls(parameter_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
                   root_bytes=sum(p.numel() * p.element_size() for p in groups.get("", [])),
                   gathered_root_bytes=n * shard.get("", 0), largest_unit_bytes=n * max(shard.values(), default=0),
                   shard_bytes=max(per_param, flat))


def _shard_bytes(params: list, n: int) -> int:
    """The most bytes of `params` (one unit) one rank holds: per parameter rows or flat, padded."""
    flat = math.ceil(sum(p.numel() for p in params) / n) * params[0].element_size()
    return max(sum(_row_padded(p, n) for p in params), flat)


def _row_padded(p, n: int) -> int:
    """The bytes of one rank's dim-0 chunk of `p`, its rows padded to a multiple of `n`."""
    if p.dim() == 0:
        return p.element_size()
    row = p.numel() // max(p.shape[0], 1)
    return math.ceil(p.shape[0] / n) * row * p.element_size()


def sent_formulas(strategy: str, p: float, n: int, r: int, root: float = 0.0) -> dict:
    """{kind: bytes a rank sends per step in a ring} by the strategy's design (module doc), for `p`
    parameter bytes of which `root` stay gathered from forward to backward."""
    ring_n, ring_r = (n - 1) / n, (r - 1) / r
    if strategy == Strategy.NO_SHARD:
        return {"all_gather": 0.0, "reduce_scatter": 0.0, "all_reduce": 2 * p * ring_r}
    if strategy == OPTIMIZER_ONLY:
        return {"all_gather": p * ring_n, "reduce_scatter": 0.0, "all_reduce": 2 * p * ring_n}
    if strategy == Strategy.SHARD_GRAD_OP:
        return {"all_gather": p * ring_n, "reduce_scatter": p * ring_n, "all_reduce": 0.0}
    across = 2 * (p / n) * ring_r if strategy == Strategy.HYBRID_SHARD else 0.0
    return {"all_gather": (2 * p - root) * ring_n, "reduce_scatter": p * ring_n, "all_reduce": across}


def sent(footprint: dict) -> float:
    return sum(row["sent"] for row in footprint["traffic"].values())


@dataclass(frozen=True)
class Row:
    """One promise: its name, the measured bytes, the bound, and how to say it."""

    name: str
    measured: float
    bound: float
    low: float = 0.0
    unit: str = "per rank"

    @property
    def broken(self) -> bool:
        return not self.low <= self.measured <= self.bound

    def line(self, promiser: str, p: float) -> str:
        """One line: the row, what was measured, what `promiser` (the strategy and its group) promises."""
        window = (f"{_kb(self.low)}-{_kb(self.bound)} ({self.low / p:.2f}x-{self.bound / p:.2f}x)" if self.low
                  else f"<= {_kb(self.bound)} ({self.bound / p:.2f}x)")
        return (f"{self.name}: {_kb(self.measured)} {self.unit} ({self.measured / p:.2f}x of the parameters); "
                f"{promiser} promises {window}")


def rows(strategy: str, n: int, r: int, measured: dict, unsharded: dict, shapes: Shapes) -> list[Row]:
    """Every promise that applies to `strategy` on shard groups of `n` ranks and `r` replicas (the
    module doc's table), as rows of `measured` against its bound."""
    u, P, U, R = unsharded, shapes.parameter_bytes, shapes.largest_unit_bytes, shapes.gathered_root_bytes
    sharded = strategy in SHARDED and n > 1
    optimizer_only = strategy == OPTIMIZER_ONLY and n > 1
    k = shapes.shard_bytes / P if sharded or optimizer_only else 1.0
    k_whole = 1.0 if optimizer_only else k  # what parameters and gradients shrink by
    held_whole = u["rest"]["total"] + u["gradients"]
    kept_whole = (u["rest"]["parameters"] if strategy == Strategy.SHARD_GRAD_OP and sharded else
                  held_whole - u["rest"]["optimizer"] if optimizer_only else 0.0)
    out = [
        Row("held between steps", measured["rest"]["total"], kept_whole + (held_whole - kept_whole) * k + SMALL),
        Row("parameters held between steps", measured["rest"]["parameters"],
            (u["rest"]["parameters"] if kept_whole else u["rest"]["parameters"] * k) + SMALL),
        Row("optimizer state", measured["rest"]["optimizer"], u["rest"]["optimizer"] * k + SMALL),
        Row("gradients after backward", measured["gradients"], u["gradients"] * k_whole + SMALL),
        Row("held after backward", measured["backward"], u["gradients"] * k_whole + SMALL),
    ]
    if optimizer_only:  # the parameters whole, once: as an all-gather redistributed them after the step
        gathered = shapes.shard_bytes * n + SMALL
    elif not sharded:
        gathered = SMALL
    elif strategy in RESHARDS_AFTER_FORWARD:
        gathered = R + PREFETCHED * U + SMALL
        out.append(Row("kept gathered after forward", measured["kept"], R + U + SMALL))
    else:
        gathered = shapes.shard_bytes * n + IN_FLIGHT * U + SMALL
    for phase in ("forward", "backward"):
        out.append(Row(f"gathered during {phase}", measured["gathered"][phase], gathered, unit="at once"))
    peak = (u["forward"] + gathered + IN_FLIGHT * U + u["gradients"] * k if sharded
            else PEAK_OF_UNSHARDED * u["peak"])
    out.append(Row("peak during the step", measured["peak"], peak + SMALL))
    padded = sent_formulas(strategy, shapes.shard_bytes * n if sharded or optimizer_only else P, n, r)  # the root re-gathered too
    traffic = measured["traffic"]
    for kind, formula in sent_formulas(strategy, P, n, r, shapes.root_bytes if sharded else 0.0).items():
        got = traffic.get(kind, {}).get("sent", 0.0)
        name = f"{kind} bytes sent"
        if kind == "all_gather" and strategy == OPTIMIZER_ONLY:
            got, name = sum(traffic.get(k, {}).get("sent", 0.0) for k in REDISTRIBUTION), "all_gather or broadcast bytes sent"
        low = LOW * formula if formula else 0.0
        out.append(Row(name, got, HIGH * padded[kind] + SMALL, low=low, unit="per step"))
    for kind, row in sorted(traffic.items()):
        if kind not in COLLECTIVES and not (strategy == OPTIMIZER_ONLY and kind in REDISTRIBUTION):
            out.append(Row(f"{kind} bytes sent", row["sent"], SMALL, unit="per step"))
    return out


def judge(strategy: str, n: int, r: int, measured: dict, unsharded: dict, shapes: Shapes) -> tuple[list[str], dict]:
    """(one line per broken promise, the figures with their bounds) for `measured` against the
    `unsharded` footprint, `strategy` on shard groups of `n` ranks and `r` replicas. The figures'
    `rows` are {row: [measured, bound] or [measured, bound, low]}, in bytes."""
    p = shapes.parameter_bytes
    judged = rows(strategy, n, r, measured, unsharded, shapes)
    promiser = f"{strategy} on {n} shard{'s' if n > 1 else ''}" + (f" x {r} replicas" if r > 1 else "")
    failures = [row.line(promiser, p) for row in judged if row.broken]
    figures = {"strategy": str(strategy), "shard_size": n, "replicas": r, "parameter_bytes": p,
               "shapes": {"root": shapes.root_bytes, "gathered_root": shapes.gathered_root_bytes,
                          "largest_unit": shapes.largest_unit_bytes, "shard": shapes.shard_bytes},
               "rows": {row.name: [row.measured, row.bound] + ([row.low] if row.low else []) for row in judged},
               "rest": {"measured": measured["rest"]["total"], "unsharded": unsharded["rest"]["total"],
                        "ratio": _ratio(measured["rest"]["total"], unsharded["rest"]["total"]),
                        "by_kind": {k: v for k, v in measured["rest"].items() if k != "total"}},
               "optimizer": {"measured": measured["rest"]["optimizer"], "unsharded": unsharded["rest"]["optimizer"]},
               "backward": {"measured": measured["backward"], "unsharded": unsharded["backward"]},
               "forward": {"measured": measured["forward"], "unsharded": unsharded["forward"]},
               "peak": {"measured": measured["peak"], "unsharded": unsharded["peak"],
                        "ratio": _ratio(measured["peak"], unsharded["peak"])},
               "sent": {"measured": sent(measured), "by_kind": measured["traffic"],
                        "formula": sum(sent_formulas(strategy, p, n, r, shapes.root_bytes).values())}}
    figures["sent"]["ratio"] = _ratio(figures["sent"]["measured"], figures["sent"]["formula"])
    return failures, figures



def materialized_whole(construction: int, shapes: Shapes) -> list[str]:
    """meta_init's promise: while the trainer is made, at most one unit whole, twice (an engine that
    materializes unit by unit and flattens it, as FSDP1, copies the unit into its flat parameter
    while the unit's own tensors are alive), and this rank's shards: never the model whole."""
    bound = 2 * shapes.largest_unit_bytes + shapes.shard_bytes + SMALL
    if construction <= bound:
        return []
    p = shapes.parameter_bytes
    return [f"built on meta: {_size(construction)} alive at once while the trainer was made ({construction / p:.2f}x "
            f"of the parameters); meta_init promises <= {_size(bound)} ({bound / p:.2f}x: one unit whole, twice, "
            f"and this rank's shards)"]


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 4) if b else None


def _kb(n: float) -> str:
    return f"{n / 1024:.1f} KiB"


def _size(n: float) -> str:
    """Bytes in the largest binary unit that keeps a number >= 1."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
