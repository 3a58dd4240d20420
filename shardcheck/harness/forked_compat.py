"""pytest-forked on pytest >= 9.2: make the forked child's reports cross back to the parent.

pytest-forked ships each report from the forked child to the parent with `marshal`, built from the
report's `__dict__`. Since pytest 9.2 (pytest-dev/pytest#14758) a report keeps its node id as a
structured `NodeId` object in `_id` instead of the `nodeid` string: `marshal.dumps` raises
"unmarshallable object" in the child, pytest-forked turns that into exit status 3, and every test
reads "running the test EXITED with status 3" (up to pytest-forked 1.7.5). Rank records in
`user_properties` may also hold types marshal rejects (numpy scalars, str subclasses).

`install()` wraps pytest-forked's `serialize_report` so the dict it returns is marshal-safe: the
node id becomes the `nodeid` string again (which `TestReport(**d)` in the parent accepts on every
pytest) and anything else marshal rejects is replaced by its repr. A no-op without pytest-forked.
"""

from __future__ import annotations

import marshal
from typing import Any


def marshal_safe(value: Any) -> Any:
    """`value` if marshal takes it, else the same structure with what it rejects as repr()."""
    try:
        marshal.dumps(value)
        return value
    except ValueError:
        pass
    if isinstance(value, tuple):
        return tuple(marshal_safe(v) for v in value)
    if isinstance(value, list):
        return [marshal_safe(v) for v in value]
    if isinstance(value, dict):
        return {marshal_safe(k): marshal_safe(v) for k, v in value.items()}
    return repr(value)


def _safe_report_dict(d: dict) -> dict:
    if "_id" in d:  # pytest >= 9.2: NodeId object; the parent rebuilds it from the string
        d["nodeid"] = str(d.pop("_id"))
    return {key: marshal_safe(value) for key, value in d.items()}


def install() -> None:
    try:
        import pytest_forked
    except ImportError:
        return
    original = pytest_forked.serialize_report
    if getattr(original, "_shardcheck_safe", False):
        return

    def serialize_report(rep):
        return _safe_report_dict(original(rep))

    serialize_report._shardcheck_safe = True
    pytest_forked.serialize_report = serialize_report
