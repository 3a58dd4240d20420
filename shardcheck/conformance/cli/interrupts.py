"""A run's last words under Ctrl-C: the exit status of an interrupted run, the report assembled from
the cells it streamed when the interrupted session never wrote it, and a third Ctrl-C kept from
cutting that short. pytest turns the first Ctrl-C into an orderly end of the session; a second one
inside that handling escapes pytest.main (and once left a footer with exit status 0)."""

from __future__ import annotations

import contextlib
import json
import signal
from pathlib import Path

class Watch:
    """Whether a Ctrl-C arrived while `watching()` was on."""

    seen = False


@contextlib.contextmanager
def watching():
    """Ctrl-C raises KeyboardInterrupt as Python's default handler does, and is remembered: pytest's own
    handling of one can itself fail (a traceback of a frame caught mid-line), and what escapes then is
    not a KeyboardInterrupt."""
    watch = Watch()

    def interrupted(signum, frame):
        watch.seen = True
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, interrupted)
    try:
        yield watch
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def no_interrupts():
    """Ctrl-C ignored while the run's last words are written: a third one must not cut the report."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def completeness(out: Path) -> str:
    """What the report says of an interrupted run: whether every collected cell finished."""
    try:
        complete = json.loads(out.read_text())["complete"]
    except (OSError, ValueError, KeyError):
        return ": no report was written"
    return (": every cell had finished, the report is complete" if complete
            else ": the report is marked complete: false")


def assemble_if_unwritten(out: Path, before: int | None) -> None:
    """The report from the cells the run streamed, when the interrupted session never wrote it."""
    from shardcheck.conformance.report import writer as reporting  # jsonschema and the report's modules: only here

    lines = reporting.stream_path(out)
    if lines.is_file() and (not out.is_file() or out.stat().st_mtime_ns == before):
        try:
            reporting.write(reporting.assemble(lines, out), out)
        except reporting.StreamError:
            pass  # interrupted before its first line: nothing to assemble
