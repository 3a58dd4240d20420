"""The torch releases this suite has been judged on: its manifests' entries were observed there.

shardcheck's torch requirement is a lower bound only (pyproject.toml): it never replaces the torch it
is asked to judge. On a release outside JUDGED, it runs and says so, since a manifest entry scoped to
the judged releases (`torch = ">=2.13,<2.14"`) does not apply there: a known bug shows as a failure
until it is judged on that release (fixed, or still present).
"""

from __future__ import annotations

from importlib import metadata

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

JUDGED_RANGE = ">=2.13,<2.14"  # the releases the committed reports and manifests were made on
JUDGED = SpecifierSet(JUDGED_RANGE)


def installed_torch() -> str | None:
    """The installed torch's version, without importing torch (None when it is not installed)."""
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def unjudged(version: str | None) -> str | None:
    """One line when torch `version` (local part ignored: 2.14.1+cu128 is 2.14.1) is outside JUDGED;
    None when it is inside, or unknown."""
    try:
        release = Version(version).base_version if version else None
    except InvalidVersion:
        return None
    if release is None or release in JUDGED:
        return None
    return (f"torch {version} is outside the releases shardcheck's expectations were judged on ({JUDGED_RANGE}): "
            f"known failures scoped to those releases do not apply, so a known bug still present shows "
            f"as a failure")
