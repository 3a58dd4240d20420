"""What each sharding strategy promises of a rank's memory and traffic, as formulas over the same
figures measured for unsharded data-parallel training (footprint.measure of the yardstick), and the
verdict of one measured footprint against them.

With ``u`` the unsharded figures, ``n`` the shard group size (the world for a 1-D strategy, the
shard dimension of HYBRID_SHARD's (replicate, shard) mesh), ``r`` the replicate dimension, ``P`` the
unsharded parameter bytes and ``SLACK`` a stated allowance for padding, alignment and bookkeeping:

    held between steps        FULL_SHARD, HYBRID_SHARD    rest        <= (u.rest + u.gradients) / n + SLACK * u.rest
    optimizer state           every sharded strategy      optimizer   <= u.optimizer / n + SLACK * u.optimizer
    gradients after backward  every sharded strategy      gradients   <= u.gradients / n + SLACK * u.gradients
    gathered after forward    FULL_SHARD, HYBRID_SHARD    forward     <= u.forward + KEPT_GATHERED * P  (n > 1)
    bytes sent per step       every strategy, n * r > 1   sent / formula within [LOW, HIGH]

    formula (ring):  FULL_SHARD     3 * P * (n-1)/n           (all-gather in forward and in backward,
                                                               reduce-scatter of the gradients)
                     HYBRID_SHARD   3 * P * (n-1)/n + 2 * (P/n) * (r-1)/r   (and an all-reduce of the
                                                               gradient shards across replicas)
                     SHARD_GRAD_OP  2 * P * (n-1)/n           (one all-gather, one reduce-scatter)
                     NO_SHARD       2 * P * (r-1)/r           (one all-reduce of the gradients over
                                                               the r replicas; n = 1)

Between steps unsharded training holds parameters and optimizer state (its gradients are set to
None); an engine may also keep its gradients there (FSDP1 frees them at the next forward), sharded
like the rest. "Sharded strategy" is FULL_SHARD, SHARD_GRAD_OP and HYBRID_SHARD (ZeRO-3, ZeRO-2, and FULL_SHARD
within a replica group); NO_SHARD promises no memory saving. The parameters kept gathered at the end
of forward may be the root unit's (FSDP does not reshard the root, it is needed first in backward):
the model these checks measure keeps less than KEPT_GATHERED of its parameters in its root. On one
rank there is nothing to gather: the shard is the parameter.
"""

from __future__ import annotations

SLACK = 0.15          # of the unsharded figure: padding to a multiple of n, alignment, small state
KEPT_GATHERED = 0.5   # of the parameters: at most this may stay gathered after forward (FULL_SHARD)
LOW, HIGH = 0.75, 1.35  # sent / formula: a step communicates as its strategy's design says
SHARDED = ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD")
RESHARDS_AFTER_FORWARD = ("FULL_SHARD", "HYBRID_SHARD")


def sent_formula(strategy: str, parameter_bytes: float, n: int, r: int = 1) -> float:
    """The bytes a rank sends per step in a ring, by the strategy's design (module doc)."""
    p = parameter_bytes
    if strategy == "NO_SHARD":  # replicated over all r ranks
        return 2 * p * (r - 1) / r
    if strategy == "SHARD_GRAD_OP":
        return 2 * p * (n - 1) / n
    across = 2 * (p / n) * (r - 1) / r if strategy == "HYBRID_SHARD" else 0.0
    return 3 * p * (n - 1) / n + across


def sent(footprint: dict) -> float:
    return sum(row["sent"] for row in footprint["traffic"].values())


def judge(strategy: str, n: int, r: int, measured: dict, unsharded: dict) -> tuple[list[str], dict]:
    """(one line per broken promise, the figures with their ratios) for `measured` against the
    `unsharded` footprint (footprint.measure), `strategy` on shard groups of `n` ranks and `r`
    replicas."""
    p = unsharded["rest"]["parameters"]
    u = unsharded
    rows = {  # name: (key, measured, unsharded, what may be held sharded, promised)
        "held between steps": ("rest", measured["rest"]["total"], u["rest"]["total"],
                               u["rest"]["total"] + u["gradients"], strategy in RESHARDS_AFTER_FORWARD),
        "optimizer state": ("optimizer", measured["rest"]["optimizer"], u["rest"]["optimizer"],
                            u["rest"]["optimizer"], strategy in SHARDED),
        "gradients after backward": ("gradients", measured["gradients"], u["gradients"], u["gradients"],
                                     strategy in SHARDED),
    }
    failures, figures = [], {"strategy": strategy, "shard_size": n, "replicas": r, "parameter_bytes": p}
    for name, (key, got, base, shardable, promised) in rows.items():
        bound = shardable / n + SLACK * base
        figures[key] = {"measured": got, "unsharded": base, "ratio": _ratio(got, base), "bound": bound}
        if promised and got > bound:
            failures.append(f"{name}: {_kb(got)} per rank, {got / base:.2f}x of unsharded at shard size {n}; "
                            f"{strategy} promises <= {bound / base:.2f}x ({_kb(bound)})")
    figures["backward"] = {"measured": measured["backward"], "unsharded": u["backward"]}
    figures["rest"]["by_kind"] = {k: v for k, v in measured["rest"].items() if k != "total"}
    kept = measured["forward"] - unsharded["forward"]
    figures["forward"] = {"measured": measured["forward"], "unsharded": unsharded["forward"],
                          "gathered": kept, "bound": KEPT_GATHERED * p}
    if strategy in RESHARDS_AFTER_FORWARD and n > 1 and kept > KEPT_GATHERED * p:
        failures.append(f"gathered after forward: {_kb(kept)} more than unsharded training holds at the end of "
                        f"forward ({kept / p:.2f}x of the parameters); {strategy} reshards after forward "
                        f"(<= {KEPT_GATHERED:.2f}x)")
    figures["peak"] = {"measured": measured["peak"], "unsharded": unsharded["peak"],
                       "ratio": _ratio(measured["peak"], unsharded["peak"])}
    formula = sent_formula(strategy, p, n, r)
    figures["sent"] = {"measured": sent(measured), "formula": formula, "ratio": _ratio(sent(measured), formula),
                       "by_kind": measured["traffic"]}
    if formula > 0 and not LOW <= sent(measured) / formula <= HIGH:
        kinds = ", ".join(f"{k} {_kb(v['sent'])}" for k, v in sorted(measured["traffic"].items())) or "nothing"
        failures.append(f"bytes sent per step: {_kb(sent(measured))} per rank ({kinds}), "
                        f"{sent(measured) / formula:.2f}x of {strategy}'s {_kb(formula)} "
                        f"(within {LOW:.2f}x-{HIGH:.2f}x)")
    return failures, figures


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 4) if b else None


def _kb(n: float) -> str:
    return f"{n / 1024:.1f} KiB"
