"""The search: hypothesis draws configurations (strategies.py), each runs as one example on the rank
pool (run.py), and a failing example is shrunk by hypothesis's own shrinker to a minimal one.

One search is a sequence of hypothesis runs ("rounds") with seeds seed, seed + 1, ...: a round ends
at its first NEW failure, shrunk; the next round looks for failures with another signature. A failure
the implementation's manifest already knows (findings.known_entry) does not fail the property: it is
counted under its finding and the search goes on. The search stops after `max_examples` examples
(deterministic for a fixed seed) or when `budget_s` seconds are spent.

While shrinking, a candidate that fails with ANOTHER signature counts as passing, so the shrinker stays
on one bug (no slippage); shrinking stops after `shrink_examples` runs (the best so far is kept).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable

from hypothesis import HealthCheck, Phase, Verbosity, assume, configuration, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis.errors import HypothesisException

from shardcheck.conformance.explore import findings, strategies
from shardcheck.conformance.explore.config import Config
from shardcheck.conformance.explore.run import EXAMPLE_TIMEOUT_S, Outcome, run_example
from shardcheck.errors import ShardcheckError


class BudgetSpent(ShardcheckError):
    """Raised inside the property once the time budget is gone (ends the round)."""


class NewFailure(ShardcheckError):
    def __init__(self, config: Config, outcome: Outcome) -> None:
        super().__init__(outcome.signature)
        self.config, self.outcome = config, outcome


@dataclass
class Limits:
    """How far a search goes: examples (all runs, shrinking included), seconds, shrink runs per
    finding, new findings (None: no limit), the world sizes drawn, the backend, one example's deadline."""

    max_examples: int = 200
    budget_s: float = 120.0
    shrink_examples: int = 150
    max_findings: int | None = None
    world_sizes: tuple[int, ...] = (1, 2, 3, 4)
    backend: str = "gloo"
    example_timeout_s: float = EXAMPLE_TIMEOUT_S


@dataclass
class Result:
    """What a search found. `findings`: new failures, shrunk; `known`: manifest findings seen
    ({finding: {count, signature, config}}); counts of examples by outcome."""

    impl: str
    seed: int
    limits: Limits
    examples: int = 0
    passed: int = 0
    unsupported: int = 0
    failed: int = 0
    seconds: float = 0.0
    rounds: int = 0
    findings: list = field(default_factory=list)
    known: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.findings


@dataclass
class Round:
    """The state of one hypothesis run: the signature it shrinks and its best failing example."""

    signature: str | None = None
    best: NewFailure | None = None
    shrink_runs: int = 0


class Search:
    def __init__(self, impl, seed: int, limits: Limits, entries: list[dict],
                 progress: Callable[[Result, str], None] | None = None) -> None:
        self.impl, self.seed, self.limits, self.entries = impl, seed, limits, entries
        self.result = Result(impl.name, seed, limits)
        self.progress = progress or (lambda result, event: None)
        self.deadline = time.monotonic() + limits.budget_s
        self.reported: set[str] = set()

    def out_of_budget(self) -> bool:
        return time.monotonic() > self.deadline or self.result.examples >= self.limits.max_examples

    def example(self, state: Round, config: Config) -> None:
        """The property: `config` trains like unsharded data-parallel training, or fails as known."""
        if state.signature is None and self.out_of_budget():
            raise BudgetSpent()
        if state.signature is not None and (state.shrink_runs >= self.limits.shrink_examples
                                            or time.monotonic() > self.deadline):
            return  # shrinking over: candidates pass, the best so far stands
        outcome = run_example(self.impl, config, self.limits.backend, self.limits.example_timeout_s)
        self.count(outcome, shrinking=state.signature is not None)
        if state.signature is not None:
            state.shrink_runs += 1
        if outcome.status == "unsupported":
            assume(False)  # rejected: never a pass
        if outcome.status == "passed":
            return
        entry = findings.known_entry(self.entries, config, outcome)
        if entry is not None:
            self.note_known(entry, config, outcome)
            return
        if outcome.signature in self.reported or state.signature not in (None, outcome.signature):
            return  # reported already, or another bug while shrinking this one
        state.signature = outcome.signature
        state.best = NewFailure(config, outcome)
        raise state.best

    def count(self, outcome: Outcome, shrinking: bool) -> None:
        r = self.result
        r.examples += 1
        setattr(r, outcome.status, getattr(r, outcome.status) + 1)
        self.progress(r, "shrink" if shrinking else outcome.status)

    def note_known(self, entry: dict, config: Config, outcome: Outcome) -> None:
        key = entry.get("finding") or entry["reason"][:40]
        seen = self.result.known.setdefault(key, {"count": 0, "signature": outcome.signature,
                                                   "config": config, "repro": entry["repro"]})
        seen["count"] += 1

    def one_round(self, index: int) -> NewFailure | None:
        with _storage_outside_the_working_folder():
            return self._one_round(index)

    def _one_round(self, index: int) -> NewFailure | None:
        """One hypothesis run (seed + index); its new failure, shrunk, or None."""
        state = Round()
        caps, sizes = self.impl.capabilities, self.limits.world_sizes

        @hypothesis_seed(self.seed + index)
        @settings(database=None, deadline=None, max_examples=max(1, self.limits.max_examples),
                  phases=(Phase.generate, Phase.shrink), report_multiple_bugs=False, verbosity=Verbosity.quiet,
                  suppress_health_check=list(HealthCheck), print_blob=False)
        @given(strategies.configs(caps, sizes))
        def prop(config):
            self.example(state, config)

        try:
            prop()
        except (NewFailure, BudgetSpent, HypothesisException):
            pass
        except BaseException as exc:  # hypothesis's FlakyFailure group, once shrinking was cut short
            if state.best is None or not isinstance(exc, BaseExceptionGroup):
                raise
        return state.best

    def run(self) -> Result:
        start = time.monotonic()
        index = 0
        while not self.out_of_budget():
            found = self.one_round(index)
            index += 1
            if found is None:
                break  # hypothesis ran out of examples, or the budget is spent
            self.reported.add(found.outcome.signature)
            self.result.findings.append(findings.Finding.of(self.impl.name, self.seed, found.config, found.outcome))
            self.progress(self.result, "finding")
            if self.limits.max_findings is not None and len(self.result.findings) >= self.limits.max_findings:
                break
        self.result.rounds = index
        self.result.seconds = time.monotonic() - start
        return self.result


def explore(impl, seed: int = 0, limits: Limits | None = None, entries: list[dict] | None = None,
            progress: Callable[[Result, str], None] | None = None) -> Result:
    """Search `impl` for configurations where it differs from unsharded data-parallel training.
    `entries`: the manifest's explore entries (known findings); None reads the implementation's."""
    if entries is None:
        entries = findings.manifest_entries(impl)
    return Search(impl, seed, limits or Limits(), entries, progress).run()


@contextlib.contextmanager
def _storage_outside_the_working_folder():
    """hypothesis keeps caches (the constants it collects from the code under test) in
    ./.hypothesis unless told otherwise: a run writes nothing into the user's folder (the checkpoint
    checks watch it), so they go to the temporary folder for the round, unless
    HYPOTHESIS_STORAGE_DIRECTORY names a place."""
    if os.environ.get("HYPOTHESIS_STORAGE_DIRECTORY"):
        yield
        return
    before = configuration.storage_directory(intent_to_write=False)
    configuration.set_hypothesis_home_dir(os.path.join(tempfile.gettempdir(), "shardcheck-hypothesis"))
    try:
        yield
    finally:
        configuration.set_hypothesis_home_dir(str(before))
