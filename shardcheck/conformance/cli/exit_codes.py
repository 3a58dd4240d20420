"""The exit status of every `shardcheck` command, one per class of outcome, the same class the same
status in every command, so a script can tell a broken implementation from a mistyped command:

    0    every collected cell reached its expected outcome (xfailed and unsupported cells included)
    1    a cell failed or errored, an implementation reached no cell, coverage below --min-coverage,
         (diff) a regression or an incomplete report, (explore, simulate) a new finding or a failed
         verdict; pytest's internal error
    2    usage: a bad option value, or a file given that is not what it should be (a report, a
         stream, a manifest, a replay file that cannot be read); pytest's usage error (an option
         after `--`)
    3    an output path that cannot be written (a folder, a file where a folder should be, no right,
         another live run's report), checked before anything runs
    4    an unknown name: implementation, variant, capability, family, model preset
    5    no cell selected (--family, --world-sizes, -k and --impl left none)
    6    an adapter that cannot be built: its module raised while it was imported, its class raised
         when called, or it lacks a method what it declares needs
    7    report merge: parts that do not make one split run (a part missing or given twice, parts of
         another selection or split plan, a report that is not a part)
    130  interrupted (Ctrl-C, however many): the report says complete: false

The numbers live in shardcheck/errors.py (the lowest module: the harness's errors carry them too);
each error class there carries its own (`ShardcheckError.exit_status`), and the command line
catches the base once (cli/main.py). `shardcheck releases` exits with the worst of its runs' 0, 1
or 2 (cli/releases.py).
"""

from __future__ import annotations

from shardcheck.errors import (ADAPTER_IMPORT, FAILED, INTERRUPTED, NO_CELL, OK, PARTS, UNKNOWN_NAME, UNWRITABLE,
                               USAGE)

__all__ = ["OK", "FAILED", "USAGE", "UNWRITABLE", "UNKNOWN_NAME", "NO_CELL", "ADAPTER_IMPORT", "PARTS",
           "INTERRUPTED", "of_pytest"]


def of_pytest(code: int) -> int:
    """pytest's exit status as this command's: its 0, 1 and 5 mean what ours do, its 2 is Ctrl-C, its
    usage error (4) is ours (2, not our 4: an unknown name), its internal error (3) a failure (not our
    3: an unwritable path)."""
    return {0: OK, 1: FAILED, 2: INTERRUPTED, 3: FAILED, 4: USAGE, 5: NO_CELL}.get(int(code), FAILED)
