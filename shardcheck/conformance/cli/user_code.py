"""The user's own code on the import path: `--impl my_pkg.adapter:Cls` and `--model my_pkg.models:build`
name modules in the project's folder, which a console script (unlike `python -m`) does not put on
sys.path. Every command that takes such a name calls `importable_from_cwd()` first, so that a name
means the same to every command."""

from __future__ import annotations

import os
import sys


def importable_from_cwd() -> None:
    """The working folder first on the import path, here and in pytest-xdist's workers (PYTHONPATH)."""
    if (cwd := os.getcwd()) not in sys.path:
        sys.path.insert(0, cwd)
    if cwd not in (paths := os.environ.get("PYTHONPATH", "").split(os.pathsep)):
        os.environ["PYTHONPATH"] = os.pathsep.join([cwd, *filter(None, paths)])
