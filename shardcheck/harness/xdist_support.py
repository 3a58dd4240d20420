"""`pytest -n gpus`: pytest-xdist's worker count from the visible devices.

xdist parses `-n` with a type function that knows only integers, `auto` and `logical`, and pytest
parses the command line (several times) before any hook of ours could rewrite it, so the plugin
teaches the `-n` option one more word instead: as soon as both plugins are registered, the option's
type is wrapped so that `gpus` becomes `devices.worker_count()` (one worker per visible device, or
half the cores without a GPU). The reason is kept for the session header.
"""

from __future__ import annotations

from shardcheck.harness import devices

WORD = "gpus"
_reason: list[str] = []  # the header line, once `-n gpus` was parsed in this process


def _find_numprocesses(parser):
    """Where `-n` is declared: the argparse action (pytest >= 9 keeps one argparse parser), else
    pytest's own `Argument` (pytest 8 builds a new argparse parser from them at every parse)."""
    optparser = getattr(parser, "optparser", None)
    actions = getattr(optparser, "_option_string_actions", {})
    action = actions.get("-n") or actions.get("--numprocesses")
    if action is not None:
        return action
    for group in [getattr(parser, "_anonymous", None), *getattr(parser, "_groups", [])]:
        for option in getattr(group, "options", []):
            if "-n" in option.names():
                return option
    return None


def teach_gpus(parser) -> bool:
    """Let `-n` accept `gpus`. Returns False when xdist (or its -n) is not registered yet."""
    action = _find_numprocesses(parser)
    if action is None:
        return False
    if getattr(action.type, "shardcheck_gpus", False):
        return True
    original = action.type

    def numprocesses(value: str):
        if value == WORD:
            count, reason = devices.worker_count()
            _reason[:] = [reason]
            return count
        return original(value)

    numprocesses.shardcheck_gpus = True
    action.type = numprocesses
    more_help = f"\nWith '{WORD}' (shardcheck): one worker per visible GPU."
    attrs = getattr(action, "_attrs", None)
    if isinstance(attrs, dict):  # pytest 8's Argument: argparse is built from these at every parse
        attrs["type"], attrs["help"] = numprocesses, (attrs.get("help") or "") + more_help
    else:
        action.help = (action.help or "") + more_help
    return True


def header_line() -> str | None:
    return _reason[0] if _reason else None
