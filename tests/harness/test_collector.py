"""The garbage collector in a session that uses shardcheck (shardcheck/harness/collector.py): young
collections every 10,000 allocations, and what the session loaded frozen once it is collected.
A session that does not use shardcheck, or chose its own thresholds, is left as it is."""

from __future__ import annotations

import gc

import pytest

import warm_python
from shardcheck.harness import collector

BODY = """
import gc
LOADED_AT_COLLECTION = ["a module-level object"]

def test_report():
    frozen = not any(o is LOADED_AT_COLLECTION for o in gc.get_objects())  # the frozen are not listed
    print("GC", gc.get_threshold(), "frozen" if frozen else "walked")
"""


def _session(tmp_path, *args: str) -> str:
    (tmp_path / "test_gc.py").write_text(BODY)
    done = warm_python.run(["-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "test_gc.py", *args],
                           cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return next(line for line in done.stdout.splitlines() if "GC" in line)


@pytest.mark.parametrize("args, expected", [
    (("--shardcheck-backend", "gloo"), f"GC {collector.THRESHOLDS} frozen"),
    ((), f"GC {collector.CPYTHON_DEFAULT} walked"),  # not a shardcheck session: untouched
])
def test_a_shardcheck_session_collects_less_often_and_froze_what_it_loaded(tmp_path, args, expected):
    assert expected in _session(tmp_path, *args)


def test_a_process_that_chose_its_own_thresholds_keeps_them():
    before = gc.get_threshold()
    try:
        gc.set_threshold(500, 5, 5)
        collector.fewer_collections()
        assert gc.get_threshold() == (500, 5, 5)
        gc.set_threshold(*collector.CPYTHON_DEFAULT)
        collector.fewer_collections()
        assert gc.get_threshold() == collector.THRESHOLDS
    finally:
        gc.set_threshold(*before)
