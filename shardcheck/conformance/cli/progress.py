"""Progress of a `shardcheck run` (a pytest plugin the command registers; not an entry point).

On a terminal: a rich progress bar (cells done / total, failures so far, elapsed) replaces
pytest's per-test letters. Elsewhere (CI logs, pipes): a plain line every `every` cells or
`interval_s` seconds, e.g. `[  120/  525] 3 failed, 40 unsupported, 35 s`. At the end,
`print_summary()` prints a families x outcomes table and coverage / conformance per implementation
and layer (shardcheck.conformance.report.coverage); `exit_code(..., min_coverage)` fails a thin run. Works under pytest-xdist: the controller
sees every worker's reports, and learns the total from the workers' collection. While a test
waits on a rank for long (shardcheck.harness.waiting announces it), the display says which test and
ranks, and for how long: `watching_waits()` around the session.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from typing import TextIO

import pytest
from rich import box
from rich.console import Console
from rich.live import Live
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table
from rich.text import Text

from shardcheck.conformance.cli import exit_codes as codes
from shardcheck.conformance.expectations.manifest import NO_REASON
from shardcheck.conformance.protocol.outcomes import BAD, MISSING_PROPERTY, NOT_REACHED, OUTCOMES, outcome_of, reason_of
from shardcheck.conformance.report import coverage
from shardcheck.conformance.report.cells import nodeid_of
from shardcheck.conformance.report.writer import PARAMS_PROPERTY, family_of
from shardcheck.harness import waiting

# What a progress line counts: the failing outcomes first, then every other one but passed (the
# count of cells done says it) and skipped (the machine's, not the implementation's).
STATUS_OUTCOMES = BAD + tuple(o for o in OUTCOMES if o not in BAD + ("passed", "skipped"))

def _console() -> Console:
    """A console on a duplicate of the real stdout: pytest's fd capture swaps fd 1 while a test
    runs, and the live display refreshes from a thread at any time."""
    stream: TextIO
    try:
        stream = open(os.dup(sys.stdout.fileno()), "w", buffering=1, closefd=True)  # noqa: SIM115
    except (AttributeError, OSError, ValueError):  # no real fd (stdout replaced, e.g. in-process)
        stream = sys.stdout
    return Console(file=stream, highlight=False)


class RunProgress:
    def __init__(self, console: Console | None = None, every: int = 50, interval_s: float = 10.0):
        self.console = console or _console()
        self.live_mode = self.console.is_terminal
        self.every, self.interval_s = every, interval_s
        self.total = 0
        self.cells: dict[str, str] = {}  # nodeid -> outcome so far, until its teardown
        self.done: Counter[tuple[str, str]] = Counter()  # (family, outcome) of finished cells
        self.impl_done: Counter[tuple[str, str, str]] = Counter()  # (impl, family, outcome)
        self.impls: dict[str, str] = {}  # nodeid -> implementation, until its teardown
        # why cells reached no verdict: (impl, outcome, reason) -> cells; (impl, capability) -> cells
        # that needed it, and those that needed it alone
        self.reasons: Counter[tuple[str, str, str]] = Counter()
        self.needed: Counter[tuple[str, str]] = Counter()
        self.needed_alone: Counter[tuple[str, str]] = Counter()
        self.why: dict[tuple[str, str], str] = {}  # (impl, capability) -> the adapter's reason
        self.interrupted = False
        self.waiting_on = ""  # the longest wait on a rank now, described (watching_waits)
        self.started = time.monotonic()
        self._last_line = (0, self.started)
        self._live: Live | None = None  # started with the first finished cell
        self._showing = threading.Lock()
        self._bar = Progress(TextColumn("shardcheck"), BarColumn(), MofNCompleteColumn(),
                             TextColumn("{task.fields[status]}"), TimeElapsedColumn(), console=self.console)
        self._task = self._bar.add_task("cells", total=None, status="")  # elapsed counts from now

    # ---- pytest hooks ----------------------------------------------------------------------

    def pytest_collection_finish(self, session):
        self.total = len(session.items)

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node, ids):
        self.total = max(self.total, len(ids))  # every worker collects the whole session

    @pytest.hookimpl(hookwrapper=True)
    def pytest_report_teststatus(self, report, config):
        """Keep pytest's category and word (its summary counts them), drop the per-test letter."""
        outcome = yield
        result = outcome.get_result()
        if result:
            category, _letter, word = result
            outcome.force_result((category, "", word))

    def pytest_runtest_logreport(self, report):
        outcome = outcome_of(report)  # the same rule as the report: a teardown error overrides a pass
        if (outcome is not None and not (report.when == "teardown" and outcome == "skipped")
                and self.cells.get(report.nodeid) in (None, "passed")):
            self.cells[report.nodeid] = outcome
        properties = dict(report.user_properties)
        impl = (properties.get(PARAMS_PROPERTY) or {}).get("impl")
        if impl:
            self.impls[report.nodeid] = impl
        if outcome in NOT_REACHED and report.when != "teardown":
            self._note_reason(impl or "-", outcome, reason_of(report), properties.get(MISSING_PROPERTY))
        if report.when in ("setup", "call"):
            return  # a cell is done with its teardown (or a crash report: when == "???")
        family, outcome = family_of(nodeid_of(report)), self.cells.pop(report.nodeid, "error")
        # a known failure that is no bug counts as its kind (by design, platform, misuse): set aside
        outcome = coverage.verdict_of({"outcome": outcome, "expectation": properties.get("expectation")})
        self.done[(family, outcome)] += 1
        self.impl_done[(self.impls.pop(report.nodeid, "-"), family, outcome)] += 1
        self._show()

    def pytest_sessionfinish(self, session):
        self.stop()

    def pytest_keyboard_interrupt(self, excinfo):
        self.interrupted = True

    def _note_reason(self, impl: str, outcome: str, reason: str, missing: dict[str, str] | None) -> None:
        if missing:
            for capability, why in missing.items():
                self.needed[(impl, capability)] += 1
                self.needed_alone[(impl, capability)] += len(missing) == 1
                self.why[(impl, capability)] = why
        else:
            self.reasons[(impl, outcome, reason)] += 1

    # ---- display ---------------------------------------------------------------------------

    @property
    def n_done(self) -> int:
        return sum(self.done.values())

    def by_outcome(self) -> Counter[str]:
        counts: Counter[str] = Counter()
        for (_family, outcome), n in self.done.items():
            counts[outcome] += n
        return counts

    @property
    def failed(self) -> bool:
        counts = self.by_outcome()
        return any(counts[o] for o in BAD)

    def status(self) -> str:
        counts = self.by_outcome()
        shown = [f"{counts[o]} {o}" for o in (*STATUS_OUTCOMES, *coverage.SET_ASIDE) if counts[o]]
        waits = f"; {self.waiting_on}" if self.live_mode and self.waiting_on else ""
        return (", ".join(shown) or "no failures") + waits

    def line(self) -> str:
        width = len(str(max(self.total, self.n_done)))
        return (f"[{self.n_done:>{width + 2}}/{self.total:>{width + 2}}] {self.status()}, "
                f"{time.monotonic() - self.started:.0f} s")

    def _show(self) -> None:
        with self._showing:  # from the hooks, and from the waits' ticker
            self._show_now()

    def _show_now(self) -> None:
        if self.live_mode:
            if self._live is None:
                self._live = Live(self._bar, console=self.console, refresh_per_second=4,
                                  redirect_stdout=False, redirect_stderr=False)
                self._live.start()
            self._bar.update(self._task, completed=self.n_done, total=max(self.total, self.n_done) or None,
                             status=self.status())
            return
        now = time.monotonic()
        last_n, last_t = self._last_line
        if self.n_done - last_n >= self.every or now - last_t >= self.interval_s or self.n_done == self.total:
            self._last_line = (self.n_done, now)
            self.console.print(self.line(), markup=False, soft_wrap=True)

    @contextlib.contextmanager
    def watching_waits(self, every_s: float = 1.0):
        """Within: tests' long waits on ranks (from this process and the xdist workers it starts)
        shown every `every_s` on the live bar, every `interval_s` as a line elsewhere."""
        folder = tempfile.mkdtemp(prefix="shardcheck-waiting-")
        before = os.environ.get(waiting.WAITING_DIR_ENV)
        os.environ[waiting.WAITING_DIR_ENV] = folder
        done = threading.Event()
        ticker = threading.Thread(target=self._tick, args=(folder, done, every_s), daemon=True,
                                  name="shardcheck-progress")
        ticker.start()
        try:
            yield
        finally:
            done.set()
            ticker.join()
            if before is None:
                os.environ.pop(waiting.WAITING_DIR_ENV, None)
            else:
                os.environ[waiting.WAITING_DIR_ENV] = before
            shutil.rmtree(folder, ignore_errors=True)

    def _tick(self, folder: str, done: threading.Event, every_s: float) -> None:
        last_line = 0.0
        while not done.wait(every_s):
            notices = waiting.overdue(folder)
            self.waiting_on = waiting.describe(notices[0]) if notices else ""
            if self.live_mode:
                self._show()
            elif notices and time.monotonic() - last_line >= self.interval_s:
                last_line = time.monotonic()
                for notice in notices:
                    self.console.print(f"{self.line()}; {waiting.describe(notice)}", markup=False, soft_wrap=True)

    def stop(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    def summary_table(self) -> Table:
        families = sorted({f for f, _ in self.done})
        columns = [o for o in (*OUTCOMES, *coverage.SET_ASIDE) if any(self.done[(f, o)] for f in families)]
        table = Table(title=f"shardcheck: {self.n_done} cells, {time.monotonic() - self.started:.0f} s")
        table.add_column("family")
        for outcome in columns:
            table.add_column(outcome, justify="right", style="red" if outcome in BAD else None)
        table.add_column("total", justify="right")
        for family in families:
            row = [self.done[(family, o)] for o in columns]
            table.add_row(family, *map(str, row), str(sum(row)))
        totals = [sum(self.done[(f, o)] for f in families) for o in columns]
        table.add_section()
        table.add_row("all", *map(str, totals), str(sum(totals)))
        return table

    def coverage(self) -> dict[str, dict[str, dict]]:
        return coverage.by_impl(({"impl": impl, "family": family,
                                  "outcome": "xfailed" if verdict in coverage.SET_ASIDE else verdict,
                                  "kind": verdict if verdict in coverage.SET_ASIDE else None}
                                 for (impl, family, verdict), n in self.impl_done.items() for _ in range(n)),
                                bugs_only=True)

    def coverage_table(self) -> Table:
        table = Table(title="coverage = reached a verdict / cells collected; conformance = passed / judged "
                            "(reached, less the known failures that are by design, platform or misuse)",
                      box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1), collapse_padding=True)
        widest = max((len(impl) for impl, _family, _outcome in self.impl_done), default=4)
        for name in ("impl", "layer", "cells", "reached", "set aside", "passed", "coverage", "conformance"):
            # an implementation's name is never cut (80-column logs): the numbers' headers wrap instead
            table.add_column(name, justify="left" if name in ("impl", "layer") else "right",
                             no_wrap=True, min_width=widest if name == "impl" else len(name))
        for impl, layers in self.coverage().items():
            for layer, t in layers.items():
                if layer == coverage.ALL and len(layers) == 2:
                    continue  # one layer: its row is the total
                low = t["coverage"] is not None and t["coverage"] < 50
                table.add_row(Text(impl), layer, str(t["collected"]), str(t["reached"]), str(t["set_aside"]),
                              str(t["passed"]),
                              Text(coverage.show(t["coverage"]), style="red" if low else ""),
                              coverage.show(t["conformance"]))
            table.add_section()
        return table

    def reason_lines(self) -> list[str]:
        """Why cells reached no verdict, per implementation: each missing capability with the cells
        it would reach (needed by N cells, M of which need nothing else), then each skip's reason."""
        lines = []
        for impl in sorted({impl for impl, _ in self.needed} | {impl for impl, _, _ in self.reasons}):
            caps = sorted((c for i, c in self.needed if i == impl), key=lambda c: -self.needed[(impl, c)])
            for cap in caps:
                n, alone = self.needed[(impl, cap)], self.needed_alone[(impl, cap)]
                lines.append(f"{impl}: unsupported: `{cap}` is needed by {n} cell{'s' if n > 1 else ''}"
                             f" ({alone} of them need nothing else): {self.why.get((impl, cap), NO_REASON)}")
            for (i, outcome, reason), n in sorted(self.reasons.items(), key=lambda kv: -kv[1]):
                if i == impl:
                    lines.append(f"{impl}: {n} {outcome}: {reason}")
        return lines

    def print_summary(self) -> None:
        if self.interrupted:
            self.console.print(f"shardcheck: interrupted after {self.n_done} of {self.total} cells: "
                               f"the tables count only those", markup=False)
        self.console.print(self.summary_table())
        self.console.print(self.coverage_table())
        lines = self.reason_lines()
        if lines:
            self.console.print("Cells that reached no verdict, and why:", markup=False)
            for line in lines:
                self.console.print(f"  {line}", markup=False, soft_wrap=True)

    def exit_code(self, pytest_code: int, min_coverage: float = 0.0) -> int:
        """pytest's code as ours (exit_codes.of_pytest), except that a run with a failed or errored cell, an implementation that
        reached no cell at all (every cell skipped or unsupported), or one whose coverage is below
        `min_coverage` percent, is never 0 (a line on stderr names it)."""
        cover = self.coverage()
        thin = coverage.below(cover, min_coverage) if min_coverage > 0 else []
        nothing = [f"shardcheck: {impl} reached no cell: every one of its {layers[coverage.ALL]['collected']} "
                   f"cells was skipped or unsupported (the reasons are above)"
                   for impl, layers in cover.items() if layers[coverage.ALL]["reached"] == 0]
        for line in nothing + thin:
            print(line, file=sys.stderr)
        if pytest_code != 0:
            return codes.of_pytest(pytest_code)
        return codes.FAILED if self.failed or thin or nothing else codes.OK
