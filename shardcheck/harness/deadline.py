"""A distributed test's time limit: the user's limit is the limit of the test body on the ranks.

pytest-timeout's limit (marker, --timeout, ini or PYTEST_TIMEOUT), or `@distributed(timeout=)`,
becomes the harness's deadline for the body, unshrunk. The harness enforces it itself, so that a
hang comes back with every rank's Python stack: the plugin answers pytest-timeout's
`pytest_timeout_set_timer` hook for distributed tests (its documented way for plugins to replace
the timer) and keeps the settings here. Starting the ranks is not the test's time: the pool is
started before the deadline runs, and pytest-timeout's own timer is armed only around the body,
as a backstop with room for the harness to collect stacks and stop the ranks.
"""

from __future__ import annotations

import contextlib

import pytest

SETTINGS = pytest.StashKey[object]()  # pytest-timeout's Settings for an item we time ourselves
BACKSTOP = pytest.StashKey[bool]()    # set while our backstop asks pytest-timeout for its timer
STOP_SLACK_S = 30.0  # after our deadline: stacks (0.3 s), the failure grace, terminate, kill


def take_over(item, settings) -> bool:
    """Called from pytest_timeout_set_timer for a test the harness times: keep pytest-timeout's
    settings for the body's deadline and tell it not to arm its timer now (False: the backstop
    below is asking, pytest-timeout arms its timer)."""
    if item.stash.get(BACKSTOP, False):
        return False
    item.stash[SETTINGS] = settings
    return True


def limit(item, own: float | None, default: float) -> float:
    """The body's deadline in seconds: @distributed(timeout=), else pytest-timeout's, else default."""
    if own:
        return float(own)
    settings = item.stash.get(SETTINGS, None)
    if settings is not None and getattr(settings, "timeout", None):
        return float(settings.timeout)
    return default


@contextlib.contextmanager
def backstop(item, seconds: float):
    """pytest-timeout's timer, armed for `seconds` around the body, if pytest-timeout had one."""
    settings = item.stash.get(SETTINGS, None)
    if settings is None or not hasattr(settings, "_replace"):
        yield
        return
    item.stash[BACKSTOP] = True
    item.config.hook.pytest_timeout_set_timer(item=item, settings=settings._replace(timeout=seconds))
    try:
        yield
    finally:
        item.config.hook.pytest_timeout_cancel_timer(item=item)
        item.stash[BACKSTOP] = False
