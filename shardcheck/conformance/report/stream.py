"""The JSON-lines file a run streams its cells to: where it lies beside the report, whether a report
can be written at a path, and the exclusive lock (fcntl.flock) a run holds on it for its whole
session, so that a second run given the same path stops before any cell runs instead of mixing its
cells into the first's. A forked child (a rank, a pool worker) lets go of its copy of the lock."""

from __future__ import annotations

import fcntl
import io
import os
from pathlib import Path
from shardcheck.errors import UsageError


class StreamError(UsageError, ValueError):
    """A JSON-lines file that holds no report (empty, no header, not UTF-8): one line."""


def stream_path(path: Path) -> Path:
    """Where the cells of the report at `path` stream: `r.json` -> `r.jsonl`."""
    return path.with_name(path.name + "l")


def unwritable(path: Path, stream: bool = True) -> str | None:
    """Why the report cannot be written at `path` (one line), or None. Creates its folder; opens both
    files for appending (and removes those it created): permission bits do not stop root. A stream
    another live run holds (lock_stream) is refused too; `stream=False`: the report alone."""
    paths = (path, stream_path(path)) if stream else (path,)
    for p in paths:
        if p.is_dir():
            return f"{p} is a directory"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        for p in paths:
            existed = p.exists()
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released by the close
            except BlockingIOError:
                return f"{p}: another shardcheck run is writing this report; give this run another path"
            finally:
                os.close(fd)
            if not existed:
                p.unlink()
    except (FileExistsError, NotADirectoryError):  # a file where a folder should be
        return f"{next(p for p in reversed(path.parents) if p.is_file())}: not a directory"
    except OSError as exc:
        return f"{exc.filename or path}: {exc.strerror}"
    return None


_LOCKED: set[int] = set()  # fds of the streams this process holds locked


def _unlock_in_child() -> None:
    """A forked child (a rank, a pool worker) closes its copies of the locked fds: the lock stays
    with the run's process alone, and dies with it even when ranks outlive it."""
    for fd in _LOCKED:
        try:
            os.close(fd)
        except OSError:
            pass
    _LOCKED.clear()


os.register_at_fork(after_in_child=_unlock_in_child)


def lock_stream(lines: Path):
    """The JSON-lines file opened for writing under an exclusive lock (fcntl.flock), emptied;
    StreamError when another live run holds it. Close the returned file to release the lock."""
    fd = os.open(lines, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StreamError(f"{lines}: another shardcheck run is writing this report; "
                          "give this run another -o/--shardcheck-report path") from None
    os.ftruncate(fd, 0)
    _LOCKED.add(fd)
    return _LockedStream(fd)


class _LockedStream(io.TextIOWrapper):
    def __init__(self, fd: int):
        super().__init__(io.FileIO(fd, "a"), line_buffering=True)
        self._fd = fd

    def close(self) -> None:
        _LOCKED.discard(self._fd)
        super().close()
