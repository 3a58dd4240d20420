"""`pytest -n gpus`: pytest-xdist's worker count from the visible devices.

xdist parses `-n` with a type function that knows only integers, `auto` and `logical`, and pytest
parses the command line (several times) before any hook of ours could rewrite it, so the plugin
teaches the `-n` option one more word instead: as soon as both plugins are registered, the option's
type is wrapped so that `gpus` becomes `devices.worker_count()` (one worker per visible device, or
half the cores without a GPU). The reason is kept for the session header.
"""

from __future__ import annotations

from harness import devices

WORD = "gpus"
_reason: list[str] = []  # the header line, once `-n gpus` was parsed in this process


def _find_numprocesses(parser):
    optparser = getattr(parser, "optparser", None)  # pytest >= 9: options live on an argparse parser
    actions = getattr(optparser, "_option_string_actions", {})
    return actions.get("-n") or actions.get("--numprocesses")


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
    action.help = (action.help or "") + f"\nWith '{WORD}' (shardcheck): one worker per visible GPU."
    return True


def header_line() -> str | None:
    return _reason[0] if _reason else None
