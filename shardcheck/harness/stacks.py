"""Ranks' Python stacks, cut to what the test body did: the harness's own frames left out.

Every body is called from one frame, in shardcheck/harness/task.py (`execute`); the frames from there outwards
are the harness's, so each kind of stack is cut at that frame: a thread's stack (thread mode), a
faulthandler dump on SIGUSR1 (a hung rank in pool or spawn mode), and a fatal signal's dump in what
a rank printed.
"""

from __future__ import annotations

import sys
import threading
import traceback

BODY_CALLER = "/harness/task.py"  # the file whose frame calls the test body


def is_harness_frame(line: str) -> bool:
    """Whether a stack line is the frame that calls the body (the harness's frames start there)."""
    return BODY_CALLER in line


def thread_stack(thread: threading.Thread) -> str:
    """A live thread's stack, outermost frame first, from the test body inwards."""
    frame = sys._current_frames().get(thread.ident)
    if frame is None:
        return "(thread already exited)"
    lines = traceback.format_stack(frame)
    body = [i for i, line in enumerate(lines) if is_harness_frame(line)]
    return "".join(lines[body[-1] + 1:] if body else lines)


def trim_stack(text: str) -> str:
    """faulthandler's dump (most recent call first), minus the harness's own threads and the
    frames below the test body."""
    blocks = []
    for block in text.strip().split("\n\n"):
        if "in watchdog" in block:
            continue
        kept = []
        for line in block.splitlines():
            if is_harness_frame(line):
                break
            kept.append(line)
        blocks.append("\n".join(kept))
    return "\n\n".join(blocks) or text


def without_harness_frames(text: str) -> list[str]:
    """The lines of a rank's output with the harness's frames dropped from fatal-signal dumps
    (they sit below the test body), and faulthandler's list of extension modules."""
    kept, below_body = [], False
    for line in text.splitlines():
        if line.startswith("  File "):
            below_body = below_body or is_harness_frame(line)
            if below_body:
                continue
        else:
            below_body = False
        if not line.startswith("Extension modules:"):
            kept.append(line)
    return kept
