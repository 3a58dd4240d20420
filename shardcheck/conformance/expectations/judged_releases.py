"""The torch releases this suite has been judged on: its manifests' entries were observed there.

shardcheck's torch requirement is a lower bound only (pyproject.toml): it never replaces the torch it
is asked to judge. On a release it was not judged on, it runs and says so, since a manifest entry
scoped to the judged releases (`torch = ">=2.13,<2.14"`) does not apply there: a known bug shows as
a failure until it is judged on that release (fixed, or still present).
"""

from __future__ import annotations

from importlib import metadata

from packaging.version import InvalidVersion, Version

# release -> the implementations whose manifests were judged on it (None: every built-in one).
# Besides 2.13.0 (the CPU build), each release's default wheel (CUDA 12.8 or 13) on a CPU-only
# machine, world sizes 1, 2 and 4, made by `shardcheck releases` (reports/releases/): every entry of
# these four reproduced on every release, none was fixed, nothing new failed (F2, F16 on 2.14.1 and
# F9, F10 on 2.9.1 with other messages: docs/releases.md).
TORCH_ENGINES = ("reference", "torch-fsdp1", "torch-fsdp2", "ddp")
JUDGED = {"2.9.1": TORCH_ENGINES, "2.10.0": TORCH_ENGINES, "2.11.0": TORCH_ENGINES, "2.12.1": TORCH_ENGINES,
          "2.13.0": None, "2.14.1": TORCH_ENGINES}


def installed_torch() -> str | None:
    """The installed torch's version, without importing torch (None when it is not installed)."""
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def unjudged(version: str | None, impls=()) -> str | None:
    """One line when torch `version` (local part ignored: 2.14.1+cu130 is 2.14.1) is not a judged
    release, or is one on which some of `impls` (names, variants allowed) were not judged; None
    when it is judged for all of them, or unknown."""
    try:
        release = Version(version).base_version if version else None
    except InvalidVersion:
        return None
    if release is None:
        return None
    consequence = ("known failures scoped to the judged releases do not apply, so a known bug still "
                   "present shows as a failure")
    if release not in JUDGED:
        return (f"torch {version} is not a release shardcheck's expectations were judged on "
                f"({', '.join(JUDGED)}): {consequence}")
    only = JUDGED[release]
    left = [i for i in impls if only is not None and i.split("[")[0] not in only]
    if left:
        return (f"torch {version}: the expectations of {', '.join(left)} were judged on "
                f"{', '.join(r for r, o in JUDGED.items() if o is None)} only: {consequence}")
    return None
