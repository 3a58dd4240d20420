"""Collectives counted per process group on each rank, and the ones not every rank of a group
issued (shardcheck.harness.isolation refuses a test that leaves any).

Every rank reports, with its result, how many collectives it has issued on each of its process
groups: the group's own sequence number, which every collective and point-to-point operation
advances, less the point-to-point operations it issued (counted at `ProcessGroup.send`/`recv`).
Counts that differ between the ranks of one group mean a collective that some rank is still waiting
on, or that the next test's first collective would be matched against. The kinds come from the
Python API's calls (the outermost: all_gather_object is one call, not the all_gathers inside it); a
collective issued below it (a functional collective) is counted, unnamed.
"""

from __future__ import annotations

import collections
import functools
import inspect
import re
import threading
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist

COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_gather_single",
    "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "broadcast",
    "broadcast_object_list", "reduce", "gather", "gather_object", "scatter", "scatter_object_list",
    "all_to_all", "all_to_all_single", "barrier", "monitored_barrier",
)


class CollectiveLedger:
    """Counts, on this rank, the collectives issued on each process group (see the module doc).

    `counts()` is {group: collectives issued since the process started}, the group named by its
    name and ranks; `issued` names them by kind, for this test only (the Python API's calls; a
    collective issued below it, such as a functional collective, is counted but has no name)."""

    def __init__(self) -> None:
        self.p2p: collections.Counter = collections.Counter()
        self.issued: collections.Counter = collections.Counter()
        self._depth = threading.local()
        self._ranks: dict[Any, str] = {}
        # (kind, weak reference to the Work) of this test's async_op collectives: weak, so that the
        # ledger never keeps a collective's tensors alive (a memory measurement would count them)
        self._works: list[tuple[str, Any]] = []
        self._install()

    def _key(self, group) -> str:
        """The group's name in counts and `issued`: "<group_name> (ranks 0, 2)" (`ranks_of` reads it back)."""
        if group not in self._ranks:
            ranks = ", ".join(map(str, dist.get_process_group_ranks(group)))
            self._ranks[group] = f"{group.group_name} (ranks {ranks})"
        return self._ranks[group]

    def _install(self) -> None:
        process_group = torch._C._distributed_c10d.ProcessGroup
        for method in ("send", "recv", "recv_anysource"):
            setattr(process_group, method, self._counting_p2p(getattr(process_group, method)))
        c10d = dist.distributed_c10d
        for name in COLLECTIVES:
            if hasattr(c10d, name):
                wrapped = self._naming(name, getattr(c10d, name))
                setattr(c10d, name, wrapped)
                if getattr(dist, name, None) is not None:
                    setattr(dist, name, wrapped)

    def _counting_p2p(self, method):
        def p2p(group, *args, **kwargs):
            self.p2p[self._key(group)] += 1
            return method(group, *args, **kwargs)
        return p2p

    def _naming(self, name: str, fn):
        params = list(inspect.signature(fn).parameters)
        at = params.index("group") if "group" in params else None

        depth = self._depth

        @functools.wraps(fn)
        def collective(*args, **kwargs):
            if getattr(depth, "n", 0):  # inside another collective of the API: it was named
                return fn(*args, **kwargs)
            group = kwargs.get("group", args[at] if at is not None and len(args) > at else None)
            self.issued[(group, name)] += 1  # the group's key is made in take_issued, not here
            depth.n = 1
            try:
                out = fn(*args, **kwargs)
            finally:
                depth.n = 0
            if hasattr(out, "is_completed"):  # async_op=True: a Work to wait on
                self._works.append((name, weakref.ref(out)))
            return out
        return collective

    def outstanding(self, grace_s: float) -> list[str]:
        """The kinds of this test's async_op collectives whose work has not completed within
        `grace_s` (a handle nobody waited on, or one no other rank matched); forgets them all."""
        works = [(kind, work) for kind, ref in self._works if (work := ref()) is not None]
        self._works = []
        end = time.monotonic() + grace_s
        while any(not work.is_completed() for _, work in works) and time.monotonic() < end:
            time.sleep(0.005)
        return [kind for kind, work in works if not work.is_completed()]

    def counts(self) -> dict[str, int]:
        """{group: collectives issued on it by this rank so far}, for every group it belongs to."""
        world = getattr(dist.distributed_c10d, "_world", None)
        out = {}
        for group in list(getattr(world, "pg_map", {})):
            try:
                sequence = group._get_sequence_number_for_group()
            except (RuntimeError, AttributeError):
                continue  # a backend without sequence numbers (threaded, fake): not counted
            key = self._key(group)
            out[key] = sequence - self.p2p[key]
        return out

    def take_issued(self) -> dict[str, dict[str, int]]:
        """{group: {kind: calls}} since the last call (a call without a group is the default one's)."""
        out: dict[str, dict[str, int]] = {}
        for (group, kind), n in self.issued.items():
            group = dist.group.WORLD if group is None else group
            if isinstance(group, torch._C._distributed_c10d.ProcessGroup):
                out.setdefault(self._key(group), {})[kind] = out.get(self._key(group), {}).get(kind, 0) + n
        self.issued.clear()
        return out


def ranks_of(group_key: str) -> tuple[int, ...]:
    """The global ranks in a group's name as the ledger writes it, "<group_name> (ranks 0, 2)"."""
    found = re.search(r"\(ranks ([\d, ]+)\)$", group_key)
    if found is None:
        raise ValueError(f"no ranks in the group name {group_key!r}")
    return tuple(int(r) for r in found.group(1).split(","))


def unmatched(collectives: dict[int, dict]) -> dict[int, str]:
    """{rank: why it fails} for the ranks that issued more collectives on a group than another of
    its ranks. `collectives`: {rank: {"counts": CollectiveLedger.counts(), "issued": take_issued()}}."""
    by_group: dict[str, dict[int, int]] = {}
    for rank, seen in collectives.items():
        for group, count in seen["counts"].items():
            by_group.setdefault(group, {})[rank] = count
    blamed: dict[int, list[str]] = {}
    for group, counts in by_group.items():
        fewest = min(counts.values())
        behind = sorted(r for r, n in counts.items() if n == fewest)
        for rank, count in counts.items():
            if count > fewest:
                extra = count - fewest
                kinds = _difference(collectives, group, rank, behind[0])
                blamed.setdefault(rank, []).append(
                    f"{extra} unmatched collective{'s' if extra > 1 else ''} on group {group} "
                    f"({kinds or 'issued below the Python API'} on rank {rank}, not on rank"
                    f"{'s' if len(behind) > 1 else ''} {', '.join(map(str, behind))})")
    return {rank: "test left " + "; ".join(parts) for rank, parts in blamed.items()}


def blame_unmatched(results: dict) -> None:
    """Fail, in `results` ({rank: RankResult}), the ranks that left unmatched collectives, when
    every rank's body returned (a rank that raised may have left its peers inside a collective:
    the counts say nothing then, and the ranks are retired anyway)."""
    if any(res.outcome == "failed" and not res.refused for res in results.values()):
        return
    counted = {r: res.collectives for r, res in results.items() if res.collectives is not None}
    for rank, why in unmatched(counted).items():
        res = results[rank]
        why = f"{why} (the next test's collectives would be matched against it)"
        res.message = f"{res.message}; {why.removeprefix('test left ')}" if res.refused else why
        res.outcome, res.refused = "failed", True


def _difference(collectives: dict[int, dict], group: str, more: int, fewer: int) -> str:
    """The kinds `more` issued on `group` beyond those `fewer` did, e.g. "all_reduce x2"."""
    mine = collections.Counter(collectives[more]["issued"].get(group, {}))
    mine.subtract(collectives[fewer]["issued"].get(group, {}))
    return ", ".join(kind if n == 1 else f"{kind} x{n}" for kind, n in sorted(mine.items()) if n > 0)
