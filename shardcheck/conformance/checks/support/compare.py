"""Comparing a sharded run with its unsharded reference: explicit per-dtype tolerances, and the
measured error of every comparison recorded for the report."""

from __future__ import annotations

import math

import torch

from shardcheck.conformance.checks.support.tensors import full_value
from shardcheck.conformance.checks.support.tolerances import BY_DTYPE

# torch.testing's defaults, named so every check and every report states what it used.
TOLERANCES = {getattr(torch, name): pair for name, pair in BY_DTYPE.items()}  # dtype: (rtol, atol)


def _worse(recorded: float, new: float) -> float:
    """The larger error; NaN wins (a NaN mismatch must never be recorded as a small error)."""
    return new if math.isnan(new) or new > recorded else recorded


def _flat(x):
    if isinstance(x, dict):
        return {k: v for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return dict(enumerate(x))
    return {"": x}


def assert_close(ctx, actual, expected, what: str, dtype: torch.dtype | None = None) -> None:
    """Assert `actual` matches `expected` (tensors, or dicts/lists of them; None must match None)
    within the tolerance of `dtype` (default: the expected tensors' dtype), and record
    {what, max_abs, max_rel, margin, rtol, atol} with `ctx.record("error", ...)`, also when it fails.
    The failure message states the largest absolute and relative errors and where they are.
    `margin` is how much of the tolerance was used: max |a - e| / (atol + rtol * |e|), at most 1
    when everything matched (NaN against NaN is 0; a NaN or infinity on one side only, infinite).

    A value matches when ``|a - e| <= atol + rtol * |e|`` elementwise, NaN matching NaN (exactly
    torch.testing.assert_close's test, which words the message of a value that does not). The
    values are compared in float64, all values of one tolerance at once: one comparison per
    tolerance rather than per tensor, which is most of what a check's comparisons cost."""
    actual, expected = _flat(actual), _flat(expected)
    failures = []
    if actual.keys() != expected.keys():
        failures.append(f"names differ: {sorted(map(str, set(actual) ^ set(expected)))}")
    by_tolerance: dict = {}  # (rtol, atol): [(key, actual float64, expected float64)]
    rtol = atol = None
    for key in (k for k in expected if k in actual):
        a, e = full_value(actual[key]), full_value(expected[key])  # a DTensor: its full value
        if e is None or a is None:
            if (e is None) != (a is None):
                failures.append(f"{key}: one side is None ({a is None=}, {e is None=})")
            continue
        rtol, atol = TOLERANCES.get(dtype or e.dtype, TOLERANCES[torch.float32])
        a64, e64 = a.to(torch.float64).cpu(), e.to(torch.float64).cpu()
        if a64.shape != e64.shape:
            failures.append(f"{key}: shape {tuple(a64.shape)} != {tuple(e64.shape)}")
            continue
        by_tolerance.setdefault((rtol, atol), []).append((key, a64, e64))
    max_abs = max_rel = margin = 0.0
    worst_abs = worst_rel = None
    for (rt, at), pairs in by_tolerance.items():
        keys = [k for k, _, _ in pairs]
        sizes = [a.numel() for _, a, _ in pairs]
        a = torch.cat([a.reshape(-1) for _, a, _ in pairs])
        e = torch.cat([e.reshape(-1) for _, _, e in pairs])
        if a.numel():
            diff = (a - e).abs()
            abs_err, abs_key = _largest(diff, keys, sizes)
            rel_err, rel_key = _largest(diff / e.abs().clamp_min(1e-12), keys, sizes)
            if worst_abs is None or _worse(max_abs, abs_err) is abs_err:  # _worse returns one of the two
                max_abs, worst_abs = _worse(max_abs, abs_err), abs_key
            if worst_rel is None or _worse(max_rel, rel_err) is rel_err:
                max_rel, worst_rel = _worse(max_rel, rel_err), rel_key
            margin = max(margin, _margin(a, e, rt, at))
        close = torch.isclose(a, e, rtol=rt, atol=at, equal_nan=True)
        if not bool(close.all()):
            for (key, a64, e64), ok in zip(pairs, close.split(sizes)):
                if not bool(ok.all()):
                    failures.append(_mismatch(key, a64, e64, rt, at))
    ctx.record("error", {"what": what, "max_abs": max_abs, "max_rel": max_rel, "margin": margin,
                         "rtol": rtol, "atol": atol})
    if failures:
        raise AssertionError(
            f"{what}: {len(failures)} mismatch(es) beyond rtol={rtol} atol={atol}; max abs error {max_abs:.3g}"
            f" (at {_name(worst_abs)}), max rel error {max_rel:.3g} (at {_name(worst_rel)}):\n  "
            + "\n  ".join(failures[:10]))


def _margin(a: torch.Tensor, e: torch.Tensor, rtol: float, atol: float) -> float:
    """max |a - e| / (atol + rtol * |e|): the share of the tolerance used by the worst value (<= 1:
    within it). Equal values (infinities of one sign, NaN against NaN) use none; a NaN or an
    infinity on one side only, all of it and more (infinite)."""
    same = (a == e) | (a.isnan() & e.isnan())
    used = ((a - e).abs() / (atol + rtol * e.abs())).masked_fill(same, 0.0)
    return float(used.nan_to_num(nan=math.inf).max())


def _largest(err: torch.Tensor, keys: list, sizes: list[int]) -> tuple[float, object]:
    """The largest value of `err` (the concatenation of tensors of `sizes`, named `keys`) and the
    key of the tensor holding it; a NaN is the largest (argmax propagates NaN)."""
    index = int(err.argmax())
    value = err[index].item()
    for key, size in zip(keys, sizes):
        if index < size:
            return value, key
        index -= size
    raise IndexError(index)


def _mismatch(key, actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float) -> str:
    """torch.testing.assert_close's own words for one mismatching value."""
    try:
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, equal_nan=True, check_dtype=False)
    except AssertionError as exc:
        lines = str(exc).splitlines()
        return f"{key}: {lines[0]}" + (f" ({lines[2].strip()})" if len(lines) > 2 else "")
    raise AssertionError(f"{key}: torch.isclose and torch.testing.assert_close disagree")  # never expected


def _name(key) -> str:
    return "-" if key is None else repr(key) if key != "" else "the value"
