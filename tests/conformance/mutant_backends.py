"""Which backend a mutant run uses: the threaded backend, unless a check it runs judges less there.

A run of the reference on threads (ranks as threads of the run's own process) costs some 2.5 times
less CPU than the same cells on gloo, a process per rank with loopback TCP under every collective.
A check that branches on ``ctx.is_threaded`` leaves a part of its verdict out on threads (bytes per
rank need a process per rank; the compile cell; a group's ranks): a run of such a check uses gloo.
``SHARDCHECK_MUTANT_BACKEND=gloo`` runs every mutant on gloo.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

CHECKS = Path(__file__).resolve().parents[2] / "shardcheck" / "conformance" / "checks"
BACKEND = os.environ.get("SHARDCHECK_MUTANT_BACKEND", "threaded")
PROCESS_BACKEND = "gloo"  # for the checks that judge less on threads


def _bodies(path: Path) -> dict[str, str]:
    """{function name: its text} of a module's top-level functions."""
    return dict(re.findall(r"^def (\w+)\((.*?)(?=^\S)", path.read_text() + "\nend", re.MULTILINE | re.DOTALL))


def threads_judge_less() -> set[str]:
    """The check functions ("file.py::function") that branch on ``ctx.is_threaded``, in their body, in
    a function of their module they call, or in a function of checks/support they call (a judgement
    shared by two families): on the threaded backend they leave a part of their verdict out (a
    process per rank measures bytes), so a run of theirs uses gloo."""
    support = {name for f in (CHECKS / "support").rglob("*.py")
               for name, body in _bodies(f).items() if "ctx.is_threaded" in body}
    out = set()
    for f in CHECKS.rglob("test_*.py"):
        bodies = _bodies(f)
        branching = {name for name, body in bodies.items() if "ctx.is_threaded" in body
                     or any(re.search(rf"\.{s}\(", body) for s in support)}
        while True:  # and the functions that call one of them
            more = {name for name, body in bodies.items()
                    if name not in branching and any(re.search(rf"\b{b}\(", body) for b in branching)}
            if not more:
                break
            branching |= more
        out |= {f"{f.name}::{name}" for name in branching if name.startswith("test_")}
    return out


THREADS_JUDGE_LESS = threads_judge_less()


def backend_of(checks) -> str:
    """The backend a run of `checks` uses: BACKEND, or gloo if a check judges less on threads."""
    return PROCESS_BACKEND if any(c.split("/")[-1] in THREADS_JUDGE_LESS for c in checks) else BACKEND
