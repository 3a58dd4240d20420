"""What shardcheck's pytest plugins share within one session: one `SessionState` in the config's stash
(`of(config)`), read and written by the entry point (shardcheck/pytest_plugin.py), the harness
(shardcheck/harness/plugin.py), the selection of implementations
(shardcheck/conformance/plugins/selection.py) and the report writer
(shardcheck/conformance/report/writer.py). No plugin keeps attributes of its own on the config, and
the writer reads what the others decided here instead of importing them.

What is decided once is frozen (`Harness`, `Selection`, each set whole when it is known); what a
session changes as it runs (`preloaded`, `locations`) is on the mutable `SessionState`. This module
imports nothing of shardcheck: every layer may import it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from shardcheck.harness.launcher import LaunchEnv


@dataclass(frozen=True)
class Harness:
    """The harness's options and surroundings, fixed at configure time (shardcheck/harness/plugin.py)."""

    backends: tuple[str, ...]  # --shardcheck-backend: every distributed test runs once per backend
    sizes: frozenset[int] | None  # --shardcheck-world-sizes: the world sizes kept; None: every one
    launch: LaunchEnv | None  # the launcher (torchrun, srun) that started this process, if one did
    main_pid: int  # the session's own process (a pytest-forked child is another)
    lease_dir: str | Path | None  # the fake devices' private directory this controller made (devices.prepare)


@dataclass(frozen=True)
class Selection:
    """The implementations checked, loaded on first use with their manifests (selection.impls)."""

    impls: dict[str, Any]  # {name as selected: adapter}
    manifests: dict[str, list[dict]]  # {name as selected: its known-failure entries}
    reasons: dict[str, dict[str, str]]  # {adapter name: {capability: why it lacks it}}


@dataclass
class SessionState:
    asked: bool = False  # an option, `-n gpus` or a launcher asked for shardcheck (the header says so)
    harness: Harness | None = None  # None until the harness plugin is configured
    selection: Selection | None = None  # None until an implementation is needed
    preloaded: bool = False  # the harness's rank_preload modules are imported in this process
    locations: dict[str, tuple] = field(default_factory=dict)  # nodeid -> location of distributed tests, for late reports


STATE = pytest.StashKey[SessionState]()


def of(config) -> SessionState:
    """The session's state, made on first use."""
    return config.stash.setdefault(STATE, SessionState())


def harness_of(config) -> Harness:
    """The harness's options, set when its plugin is configured (every hook that reads them runs later)."""
    harness = of(config).harness
    if harness is None:
        raise RuntimeError("shardcheck's harness options were read before its plugin was configured")
    return harness
