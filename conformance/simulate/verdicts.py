"""Verdict cells: measured rows / collectives against the expectations, passed or failed.

Each cell is ``{"check", "rank", "outcome": "passed"|"failed", "detail"}``; ``detail`` names the
first few mismatches, one line each.
"""
from __future__ import annotations

MAX_DETAIL = 5


def _cell(check: str, rank, problems: list[str], ok_detail: str) -> dict:
    return {"check": check, "rank": rank, "outcome": "failed" if problems else "passed",
            "detail": problems[:MAX_DETAIL] + ([f"... {len(problems) - MAX_DETAIL} more"] if len(problems) > MAX_DETAIL else [])
            if problems else [ok_detail]}


def _local_shape(shape: list[int]) -> list[int]:
    return shape or [1]  # a 0-d shard is reported as one row


def sharded_dim0(measured: list[dict], expected: list[dict], rank: int) -> dict:
    """Every parameter is split along dim 0 exactly like ``torch.chunk``: shape and padding."""
    problems = []
    got = {r["name"]: r for r in measured}
    for e in expected:
        m = got.get(e["name"])
        if m is None:
            problems.append(f"{e['name']}: missing from the sharded model")
        elif _local_shape(m["local_shape"]) != _local_shape(e["local_shape"]) or m["padded_rows"] != e["padded_rows"]:
            problems.append(f"{e['name']}: local {m['local_shape']} + {m['padded_rows']} pad rows, "
                            f"expected {e['local_shape']} + {e['padded_rows']}")
    problems += [f"{n}: not in the unsharded model" for n in sorted(set(got) - {e["name"] for e in expected})]
    return _cell("every_param_sharded_dim0", rank, problems, f"{len(expected)} parameters match torch.chunk")


def bytes_within_ceil_bound(measured: list[dict], expected: list[dict], rank: int) -> dict:
    """No rank holds more than ``ceil(n / ws)`` rows of storage for any parameter, nor in total."""
    problems = []
    bound = {e["name"]: e["bound_bytes"] for e in expected}
    for m in measured:
        limit = bound.get(m["name"])
        if limit is not None and m["storage_bytes"] > limit:
            problems.append(f"{m['name']}: holds {m['storage_bytes']} B, bound ceil(n/ws) rows = {limit} B")
    held, total = sum(m["storage_bytes"] for m in measured), sum(bound.values())
    if held > total:
        problems.append(f"total: holds {held} B, bound {total} B")
    return _cell("bytes_per_rank_within_ceil_bound", rank, problems, f"holds {held} B <= bound {total} B")


def collectives_per_step(measured: dict, expected: dict, rank) -> dict:
    """Calls and bytes per collective kind equal the implementation's design formula."""
    problems = []
    for kind in sorted(set(measured) | set(expected)):
        m = measured.get(kind, {"count": 0, "bytes": 0})
        e = expected.get(kind, {"count": 0, "bytes": 0})
        if (m["count"], m["bytes"]) != (e["count"], e["bytes"]):
            problems.append(f"{kind}: {m['count']} calls / {m['bytes']} B, expected {e['count']} / {e['bytes']} B")
    summary = ", ".join(f"{k} x{v['count']}" for k, v in sorted(measured.items())) or "none"
    return _cell("collectives_per_step", rank, problems, summary)
