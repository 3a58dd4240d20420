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
    """Calls and bytes per collective kind equal the implementation's design formula, and (where
    the expectation names them) every call of a kind ran in the expected group of ranks."""
    problems = []
    for kind in sorted(set(measured) | set(expected)):
        m = measured.get(kind, {"count": 0, "bytes": 0})
        e = expected.get(kind, {"count": 0, "bytes": 0})
        if (m["count"], m["bytes"]) != (e["count"], e["bytes"]):
            problems.append(f"{kind}: {m['count']} calls / {m['bytes']} B, expected {e['count']} / {e['bytes']} B")
        elif "groups" in e and m.get("groups", []) != e["groups"]:
            problems.append(f"{kind}: in groups {m.get('groups', [])}, expected {e['groups']}")
    summary = ", ".join(f"{k} x{v['count']}" for k, v in sorted(measured.items())) or "none"
    return _cell("collectives_per_step", rank, problems, summary)


def every_rank_by_class(per_rank: list[dict], classes, mesh, layouts: list[dict]) -> dict:
    """The ranks not simulated, by arithmetic.  ``classes`` (``expected.rank_classes``) partition the
    ``S`` shard ranks into intervals that, by the expectation, hold alike; then
    * the simulated ranks of one class -- both ends, first and last replica -- hold alike (per
      parameter: local shape, padding, storage), so the class does, and so does every replica;
    * every class has a simulated rank, and ``sum over classes of |class| x measured rows == n``
      for every parameter: each row is held by exactly one rank of every shard group, and the world
      holds ``R x`` the model's bytes.
    """
    problems = []
    if not classes or classes[0][0] != 0 or classes[-1][1] != mesh.shard or \
            any(b != c for (_, b), (c, _) in zip(classes, classes[1:])):
        problems.append(f"classes {classes} do not partition shard ranks 0..{mesh.shard - 1}")
    seen: dict[int, tuple[int, dict]] = {}  # class index -> (rank, {name: (local rows, pad, storage)})
    for r in per_rank:
        s = mesh.coords(r["rank"])[1]
        k = next((i for i, (a, b) in enumerate(classes) if a <= s < b), None)
        if k is None:
            continue
        held = {p["name"]: ((p["local_shape"] or [1])[0], p["padded_rows"], p["storage_bytes"]) for p in r["params"]}
        if k not in seen:
            seen[k] = (r["rank"], held)
        elif held != seen[k][1]:
            diff = sorted(n for n in set(held) | set(seen[k][1]) if held.get(n) != seen[k][1].get(n))
            problems.append(f"ranks {seen[k][0]} and {r['rank']} (class {classes[k][0]}..{classes[k][1] - 1}) "
                            f"differ in {len(diff)} parameters, e.g. {diff[0]}: {seen[k][1].get(diff[0])} "
                            f"vs {held.get(diff[0])}")
    missing = [c for i, c in enumerate(classes) if i not in seen]
    if missing:
        problems.append(f"{len(missing)} classes without a simulated rank, "
                        f"e.g. shard ranks {missing[0][0]}..{missing[0][1] - 1}")
    for p in layouts if not missing else []:
        rows = sum((b - a) * seen[k][1].get(p["name"], (0,))[0] for k, (a, b) in enumerate(classes))
        if rows != p["rows"]:
            problems.append(f"{p['name']}: shard ranks hold {rows} rows in all, the parameter has {p['rows']}")
    model_bytes = sum(p["rows"] * p["row_numel"] * p["itemsize"] for p in layouts)
    ok = (f"{mesh.shard} shard ranks in {len(classes)} class{'es' if len(classes) != 1 else ''} x "
          f"{mesh.replicate} replica{'s' if mesh.replicate != 1 else ''} = {mesh.world_size} ranks: every row "
          f"held once per shard group, the world holds {mesh.replicate} x {model_bytes} B")
    return _cell("every_rank_by_class", "all", problems, ok)
