"""Measured errors: a mismatch message states the largest absolute and relative error and the worst
parameter; the comparison is recorded also when it fails; the report cell takes the largest error
over every rank's records (failed ranks included), a NaN winning and written as "nan"; the
margin, the share of the tolerance the worst value used, as a JSON number."""

from __future__ import annotations

import json
import math

import pytest
import torch

from shardcheck.conformance.checks.support.compare import assert_close
from shardcheck.conformance.report import reading
from shardcheck.conformance.report import writer as reporting


class _Ctx:
    def __init__(self):
        self.records = []

    def record(self, key, value):
        self.records.append((key, value))


def test_mismatch_message_names_max_abs_max_rel_and_where():
    ctx = _Ctx()
    expected = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([4.0])}
    actual = {"w": torch.tensor([1.0, 2.5]), "b": torch.tensor([4.0 + 1e-3])}
    with pytest.raises(AssertionError) as info:
        assert_close(ctx, actual, expected, "step 0 gradients")
    first = str(info.value).splitlines()[0]
    assert first == ("step 0 gradients: 2 mismatch(es) beyond rtol=1.3e-06 atol=1e-05; max abs error 0.5 "
                     "(at 'w'), max rel error 0.25 (at 'w'):")
    [(key, rec)] = ctx.records  # recorded although it failed
    assert key == "error" and rec["max_abs"] == pytest.approx(0.5) and rec["max_rel"] == pytest.approx(0.25)


def test_names_that_differ_still_record_and_fail():
    ctx = _Ctx()
    with pytest.raises(AssertionError, match=r"names differ: \['x'\]"):
        assert_close(ctx, {"w": torch.ones(1), "x": torch.ones(1)}, {"w": torch.ones(1)}, "params")
    assert ctx.records[0][1]["max_abs"] == 0.0


def test_a_nan_is_the_worst_error_and_named():
    ctx = _Ctx()
    with pytest.raises(AssertionError, match=r"max abs error nan \(at 'n'\)"):
        assert_close(ctx, {"a": torch.tensor([2.0]), "n": torch.tensor([math.nan])},
                     {"a": torch.tensor([1.0]), "n": torch.tensor([1.0])}, "loss")


def test_report_cell_takes_every_ranks_records_nan_first(tmp_path):
    writer = reporting.ReportWriter(None, tmp_path / "r.json")
    rep = pytest.TestReport("shardcheck/conformance/checks/api/test_clip_grad.py::test_x[ref-ws2]", ("f", 0, "x"), {},
                            "failed", "E   AssertionError: total norm", "call")
    rep.user_properties = [("error", {0: [{"what": "a", "max_abs": 0.5, "max_rel": 0.1, "rtol": 1e-6, "atol": 1e-5}],
                                      1: [{"what": "a", "max_abs": 2.0, "max_rel": math.nan, "rtol": 1e-6,
                                           "atol": 1e-5}]})]
    writer.pytest_runtest_logreport(rep)
    writer.stream.close()
    [cell] = [json.loads(line) for line in writer.lines.read_text().splitlines()]
    assert cell["outcome"] == "failed" and cell["layer"] == "api"
    assert cell["max_abs_err"] == 2.0 and cell["max_rel_err"] == "nan"  # not NaN: JSON has none
    assert cell["tolerances"] == [[1e-6, 1e-5]]
    report = {"schema_version": 2, "cells": [cell]}
    problem = reading.validate(report)
    assert problem is None or not problem.startswith("$.cells"), problem


@pytest.mark.parametrize("actual, expected, margin", [
    ([1.0, 2.0], [1.0, 2.0], 0.0),
    ([1.0 + 2 ** -18], [1.0], 2 ** -18 / (1e-5 + 1.3e-6)),  # within: less than 1 (exact in float32)
    ([1.5], [1.0], 0.5 / (1e-5 + 1.3e-6)),          # beyond: more than 1
    ([math.nan, math.inf], [math.nan, math.inf], 0.0),  # NaN against NaN, equal infinities: none used
    ([math.nan], [1.0], math.inf), ([math.inf], [-math.inf], math.inf), ([1.0], [math.inf], math.inf),
])
def test_the_margin_is_the_share_of_the_tolerance_the_worst_value_used(actual, expected, margin):
    ctx = _Ctx()
    try:
        assert_close(ctx, torch.tensor(actual), torch.tensor(expected), "x")
    except AssertionError:
        assert margin > 1
    assert ctx.records[0][1]["margin"] == pytest.approx(margin, rel=1e-6)


def test_the_report_keeps_the_worst_margin_as_a_json_number(tmp_path):
    writer = reporting.ReportWriter(None, tmp_path / "r.json")
    for name, margins in (("finite", [0.25, 0.5]), ("infinite", [0.25, math.inf]), ("none", [])):
        rep = pytest.TestReport(f"shardcheck/conformance/checks/api/test_clip_grad.py::test_{name}[ref-ws2]", ("f", 0, "x"),
                                {}, "passed", None, "call")
        rep.user_properties = [("error", {r: [{"what": "a", "max_abs": 0.0, "max_rel": 0.0, "margin": m,
                                               "rtol": 1e-6, "atol": 1e-5}] for r, m in enumerate(margins)})]
        writer.pytest_runtest_logreport(rep)
    writer.stream.close()
    cells = [json.loads(line) for line in writer.lines.read_text().splitlines()]
    assert [c["max_margin"] for c in cells] == [0.5, 1.7976931348623157e308, None]
    assert all(reading.cell_problem({k: v for k, v in c.items() if k != "kind"}) is None for c in cells)
