"""Python processes that start warm, for the suite's many child runs (`python -m pytest ...`,
`python repro.py`).

Each child run of a fresh interpreter imports torch and torch._dynamo again: about 4 s of CPU, and
the suite starts some eighty of them (mutant runs, reproductions, child pytest sessions). `run`
starts the child from a multiprocessing fork server that imported those modules once: still a
process of its own (its own pid, module state, environment and working directory; what it patches
stays there; killed on timeout), only without the imports. Its stdout and stderr go to files and
come back as text, as `subprocess.run(..., capture_output=True, text=True)` gives them.
"""

from __future__ import annotations

import dataclasses
import gc
import multiprocessing
import os
import runpy
import sys
import tempfile
import threading

PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "pytest"]
# Not shardcheck's modules nor pytest plugins: a child session could no longer rewrite their asserts
# (PytestAssertRewriteWarning, a warning in every child's summary), for ~0.15 s of CPU a child.
_LOCK = threading.Lock()
_LIVE: set = set()  # children still running, for kill_live()


@dataclasses.dataclass
class Completed:
    args: list[str]
    returncode: int
    stdout: str
    stderr: str


def _context():
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


def _child(argv: list[str], cwd: str, env: dict, stdout: str, stderr: str) -> None:
    """In the fork server's child: become `python *argv` in `cwd` with `env`, writing to the files
    `stdout` and `stderr`."""
    # What the server imported stays for the child's life: out of the collector's sight (pytest
    # collects twice at the end of a session, 0.3 s of CPU with torch's objects in view; O(1) here).
    gc.freeze()
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # recomputed from this environment's TMPDIR, as at start-up
    sys.path[:0] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]  # as at start-up
    for target, path in ((1, stdout), (2, stderr)):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, target)
        os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    sys.stdin = open(os.devnull)
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path.insert(0, os.getcwd())  # as `python -m` does
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            runpy.run_path(argv[0], run_name="__main__")
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def run(argv: list[str], *, cwd, env: dict | None = None, timeout: float) -> Completed:
    """`python *argv` (e.g. ``["-m", "pytest", ...]`` or ``["repro.py"]``) as a warm child; waits
    at most `timeout` seconds, then kills it (returncode -9, a note appended to the output)."""
    with tempfile.NamedTemporaryFile("r", suffix=".out", errors="replace") as out, \
            tempfile.NamedTemporaryFile("r", suffix=".err", errors="replace") as err:
        environ = dict(os.environ if env is None else env)
        proc = _context().Process(target=_child, args=(list(argv), str(cwd), environ, out.name, err.name))
        with _LOCK:
            proc.start()
            _LIVE.add(proc)
        try:
            proc.join(timeout)
            note = ""
            if proc.is_alive():
                proc.kill()
                proc.join()
                note = f"\n(killed: still running after {timeout} s)"
        finally:
            with _LOCK:
                _LIVE.discard(proc)
        return Completed([sys.executable, *argv], proc.exitcode, out.read(), err.read() + note)


def kill_live() -> None:
    """Kill the children still running (a session that ends early)."""
    with _LOCK:
        for proc in list(_LIVE):
            proc.kill()
