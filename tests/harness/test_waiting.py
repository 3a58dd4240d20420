"""A long wait on ranks is announced (shardcheck.harness.waiting): a notice per waiting process,
naming the test, the ranks not answered and the seconds waited, gone when the wait ends."""

from __future__ import annotations

import json
import time

from shardcheck.harness import waiting
from shardcheck.harness.task import RankResult


def test_an_overdue_wait_is_announced_with_its_ranks_and_the_notice_goes_with_it(tmp_path, monkeypatch):
    monkeypatch.setenv(waiting.WAITING_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(waiting, "NOTICE_EVERY_S", 0.01)
    seen = []

    def poll(pending, wait_s):  # rank 0 answers at once, rank 1 never
        seen.append([json.loads(p.read_text()) for p in tmp_path.glob("*.json")])
        return {0: RankResult(0, "passed", "")} if 0 in pending else {}

    results, pending = waiting.wait_for_ranks(2, 0.4, poll, "t.py::test_x[ws2]")  # overdue after 0.1 s
    assert set(results) == {0} and pending == {1}
    notices = [n for found in seen for n in found]
    assert notices, "no notice while rank 1 was overdue"
    assert all(n["test"] == "t.py::test_x[ws2]" and n["pending"] == [1] and n["deadline_s"] == 0.4 for n in notices)
    assert min(n["waited_s"] for n in notices) >= 0.1  # not before a quarter of the deadline
    assert not list(tmp_path.iterdir())  # the notice is gone with the wait
    assert waiting.describe(notices[-1]).startswith("waiting 0 s on t.py::test_x[ws2]: rank 1 of 2 not answered (deadline 0.4 s")


def test_without_the_folder_nothing_is_written_and_the_wait_is_one_poll(monkeypatch):
    monkeypatch.delenv(waiting.WAITING_DIR_ENV, raising=False)
    waits = []

    def poll(pending, wait_s):  # blocks as long as it may, as the modes' polls do
        waits.append(wait_s)
        time.sleep(wait_s)
        return {}

    results, pending = waiting.wait_for_ranks(1, 0.2, poll)
    assert pending == {0} and len(waits) == 1 and waits[0] > 0.15
