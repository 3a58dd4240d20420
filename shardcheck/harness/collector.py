"""Python's garbage collector in shardcheck's processes: fewer passes over what lives for the process.

A process that imported torch holds some 400,000 objects that live as long as it does. With
CPython's default thresholds, (700, 10, 10), a full collection runs whenever the objects that
survived young collections grow by a quarter, and each walks all of them: a handful while torch
and the tests import, and three more as a pytest session ends (`pytest_unconfigure` collects
twice, the interpreter once at exit). Summed over the processes of the project's test command
(xdist workers, ranks, child runs, `shardcheck run`), the two measures below halve the time spent
collecting (counted with callbacks on `gc.callbacks`; the figures: docs/speed.md).

- `fewer_collections`: young collections every 10,000 allocations instead of 700. Reference cycles
  are still found, later; memory checks collect explicitly before they read what is alive.
- `freeze_the_long_lived`: `gc.freeze()`, which moves every object alive now to a generation no
  collection walks. Called once what is loaded stays (after the imports and collection of a
  session; in a rank, after what it inherited). Garbage among them is never freed: call it at the
  moments where that is true.
"""

from __future__ import annotations

import gc

CPYTHON_DEFAULT = (700, 10, 10)
THRESHOLDS = (10_000, 10, 10)


def fewer_collections() -> None:
    """Raise the first generation's threshold to `THRESHOLDS`, unless this process chose its own."""
    if gc.get_threshold() == CPYTHON_DEFAULT:
        gc.set_threshold(*THRESHOLDS)


def freeze_the_long_lived() -> None:
    """Everything alive now out of every later collection's walk (`gc.freeze`)."""
    gc.freeze()
