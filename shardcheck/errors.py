"""The one family of errors shardcheck raises on purpose, and the exit statuses they carry.

Every error class of the package derives from `ShardcheckError` (alongside the builtin it always
was: a `ManifestError` is still a `ValueError`), and carries `exit_status`: the status the
`shardcheck` command ends with when one reaches it. The command line catches the base once
(shardcheck/conformance/cli/main.py): one line on stderr, that status.

The statuses are numbered here, in the lowest module, so that the harness's errors (the harness
imports nothing of the conformance suite) carry them too; shardcheck/conformance/cli/exit_codes.py
says what each means, and is where the commands take them from. This module imports nothing.
"""

from __future__ import annotations

OK = 0
FAILED = 1
USAGE = 2
UNWRITABLE = 3
UNKNOWN_NAME = 4
NO_CELL = 5
ADAPTER_IMPORT = 6
PARTS = 7
INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a process ended by Ctrl-C


class ShardcheckError(Exception):
    """An error shardcheck raises on purpose; its message is one line. `exit_status`: the command's."""

    exit_status: int = FAILED


class UsageError(ShardcheckError):
    """Bad input: an option value, or a file given that is not what it should be (malformed)."""

    exit_status = USAGE


class UnknownName(ShardcheckError, LookupError):
    """A name that names nothing: an implementation, variant, capability, family, model preset."""

    exit_status = UNKNOWN_NAME
