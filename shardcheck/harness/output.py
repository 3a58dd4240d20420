"""What a rank printed, brought back to the parent at a bounded size; and the pools' temporary folders.

A failed rank's output from its test comes back with the failure, but a rank may print megabytes
(one 5 MB line is enough to flood pytest's output and the report). `output_since` keeps the first and
last few KB with a marker saying how much was left out and where the whole text is kept.

Each pool works in a temporary folder named after the pytest process that owns it
(`shardcheck-pool-<pid>-...`). A SIGKILLed pytest cannot remove its folder; `clean_stale_pool_dirs`
removes those whose owner no longer exists when the next pool starts.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile

from shardcheck.harness.stacks import without_harness_frames

HEAD_BYTES = 2048   # kept from the start of a long output
TAIL_BYTES = 6144   # kept from its end (the last lines usually say what went wrong)
MAX_LINES = 40
POOL_DIR_PREFIX = "shardcheck-pool-"
_POOL_DIR = re.compile(re.escape(POOL_DIR_PREFIX) + r"(\d+)-")


def pool_dir() -> str:
    """A private temporary folder for a new pool, named after this (owning) process."""
    clean_stale_pool_dirs()
    return tempfile.mkdtemp(prefix=f"{POOL_DIR_PREFIX}{os.getpid()}-")


def output_path(stack_path: str) -> str:
    """Where a rank writes what it prints: next to its stack file, in its pool's folder."""
    return stack_path.replace("stacks-", "output-")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def clean_stale_pool_dirs(root: str | None = None) -> list[str]:
    """Remove pool folders whose owning process is gone (a SIGKILLed pytest); return them."""
    root = root or tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        match = _POOL_DIR.match(name)
        if match and not _pid_alive(int(match.group(1))):
            path = os.path.join(root, name)
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def trim_text(text: str, where: str | None = None) -> str:
    """`text` if short; else its first and last few KB around a marker (naming `where` the whole
    text is kept, if given)."""
    data = text.encode(errors="replace")
    if len(data) <= HEAD_BYTES + TAIL_BYTES:
        return text
    left_out = len(data) - HEAD_BYTES - TAIL_BYTES
    kept = f"; whole output in {where}" if where else ""
    head = data[:HEAD_BYTES].decode(errors="replace")
    tail = data[-TAIL_BYTES:].decode(errors="replace")
    return f"{head}\n[... {left_out} bytes trimmed{kept}]\n{tail}"


def _keep_copy(path: str, offset: int, label: str) -> str:
    """Copy the output from `offset` on to a file that outlives the pool's folder; its path."""
    fd, kept = tempfile.mkstemp(prefix=f"shardcheck-output-{label}-", suffix=".log")
    with open(path, "rb") as src, os.fdopen(fd, "wb") as dst:
        src.seek(offset)
        shutil.copyfileobj(src, dst)
    return kept


def _last_lines(text: str) -> str:
    """The last MAX_LINES lines of `text`, without the harness's frames (see shardcheck/harness/stacks.py)."""
    return "\n".join(without_harness_frames(text)[-MAX_LINES:]).rstrip()


def output_since(path: str, offset: int, label: str) -> str:
    """What was written to `path` since `offset`: the last lines, or, when that is more than a few
    KB, its start and end with a marker naming a kept copy of the whole."""
    try:
        size = os.path.getsize(path) - offset
        if size <= HEAD_BYTES + TAIL_BYTES:
            with open(path, errors="replace") as f:
                f.seek(offset)
                return trim_text(_last_lines(f.read()))
        with open(path, "rb") as f:
            f.seek(offset)
            head = f.read(HEAD_BYTES).decode(errors="replace")
            f.seek(offset + size - TAIL_BYTES)
            tail = _last_lines(f.read(TAIL_BYTES).decode(errors="replace"))
        kept = _keep_copy(path, offset, label)
    except OSError:
        return ""
    return f"{head}\n[... {size - HEAD_BYTES - TAIL_BYTES} bytes trimmed; whole output in {kept}]\n{tail}"
