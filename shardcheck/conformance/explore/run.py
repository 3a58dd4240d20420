"""Running one drawn configuration: on the ranks, the candidate against unsharded data-parallel
training (`parity.train_in_parity`, the behaviour layer's oracle); in the parent, `shardcheck.harness.run` on
the persistent rank pool and the example's outcome.

The configuration travels to the ranks as plain data (`config.to_json`); a hang (the example's
deadline) or a crash of a rank comes back as a failed verdict like any exception.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

import shardcheck.harness
from shardcheck.conformance.checks.support.parity import train_in_parity
from shardcheck.conformance.explore import model
from shardcheck.conformance.explore.config import Config, from_json, to_json
from shardcheck.conformance.protocol.outcomes import is_unsupported_message
from shardcheck.conformance.plugins.selection import RANK_PRELOAD

EXAMPLE_TIMEOUT_S = 60.0


def train_example(ctx, impl, config: dict) -> None:
    """The rank body: train the drawn configuration with `impl` and with the unsharded reference,
    comparing loss, gradients, total norm, skip decisions, loss scale and parameters every step."""
    cfg = from_json(config)
    train_in_parity(ctx, impl, model.build(cfg), model.spec(ctx, cfg), model.recipe(cfg),
                    model.batches(ctx, cfg), dtype=model.tolerance_dtype(cfg))


@dataclass(frozen=True)
class Outcome:
    """One example's outcome: "passed", "failed" or "unsupported"; `message` the verdict's text,
    `signature` a failure's short, number-free identity (which failures are the same), `seconds`."""

    status: str
    message: str = ""
    signature: str = ""
    seconds: float = 0.0

    @property
    def headline(self) -> str:
        return self.message.strip().splitlines()[0] if self.message.strip() else ""


def signature(headline: str) -> str:
    """A failure's identity, free of ranks, step numbers and measured values: the exception and the
    first clause of its message (up to ': ', ', ', ' (' or '. '), digits replaced by N. 'rank 1: AssertionError: step 2 gradients: 1
    mismatch(es)... (2 of 2 ranks failed)' -> 'AssertionError: step N gradients'."""
    text = re.sub(r"^rank \d+:\s*", "", headline.strip())
    text = re.sub(r"\s*\(\d+ of \d+ ranks failed.*$", "", text)
    kind, sep, rest = text.partition(": ")
    clause = re.split(r": |, | \(|\. ", rest)[0] if sep else ""
    clause = re.sub(r"\d+(\.\d+)?(e[-+]?\d+)?", "N", clause)[:120]
    return f"{kind}: {clause}" if clause else kind


def run_example(impl, config: Config, backend: str = "gloo", timeout: float = EXAMPLE_TIMEOUT_S) -> Outcome:
    """Run `config` on `config.world_size` ranks of `backend` (the persistent pool for gloo)."""
    shardcheck.harness.preload(RANK_PRELOAD)  # as the pytest plugin does (outside pytest here)
    start = time.monotonic()
    verdict = shardcheck.harness.run(train_example, config.world_size, backend=backend, timeout=timeout,
                          impl=impl, config=to_json(config))
    seconds = time.monotonic() - start
    if verdict.outcome == "passed":
        return Outcome("passed", seconds=seconds)
    if verdict.outcome == "skipped" and is_unsupported_message(verdict.message):
        return Outcome("unsupported", verdict.message, seconds=seconds)
    if verdict.outcome == "skipped":  # the machine cannot run it (e.g. DeepSpeed in thread mode)
        return Outcome("unsupported", f"skipped: {verdict.message}", seconds=seconds)
    head = verdict.message.strip().splitlines()[0] if verdict.message.strip() else "failed"
    return Outcome("failed", verdict.message, signature(head), seconds)
