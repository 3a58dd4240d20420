"""Schema version 3: the cells as rows through tables (shardcheck.conformance.report.compact) give back the same
cells, failure texts are trimmed with ranks that agree grouped (shardcheck.conformance.report.texts), a report
says where the full text is, and the committed report is a tenth of its version 2 size."""

import copy
import json
from pathlib import Path

import pytest

from shardcheck.conformance.report import compact, matrix, reading, texts
from shardcheck.conformance.report import writer as reporting

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "reports" / "cpu-gloo.json"
IMPLS = [{"name": "fsdp", "selected_as": "fsdp", "version": "1", "adapter": "m:A", "capabilities": []},
         {"name": "fsdp", "selected_as": "pkg.mod:FSDP", "version": "1", "adapter": "m:A", "capabilities": []}]

FRAME = '  File "/venv/lib/python3.11/site-packages/{}", line {}, in {}\n    {}\n    ^^^^^^\n'
TRACE = ("Traceback (most recent call last):\n"
         '  File "/work/main/shardcheck/conformance/checks/api/test_x.py", line 10, in test_x\n    model(batch)\n'
         + FRAME.format("torch/nn/modules/module.py", 1778, "_wrapped_call_impl", "return self._call_impl()")
         + FRAME.format("torch/nn/modules/module.py", 1789, "_call_impl", "return forward_call()")
         + FRAME.format("torch/distributed/fsdp/_runtime_utils.py", 521, "_root_pre_forward", "_lazy_init()")
         + FRAME.format("torch/distributed/fsdp/_flat_param.py", 1260, "init", "shard.pin_memory()")
         + "RuntimeError: no accelerator (object at {})")
MESSAGE = ("rank 1: RuntimeError: no accelerator (object at 0x7fede8eacfe0) (3 of 3 ranks failed; then, as a "
           "consequence, ranks 0, 2)\n---------- rank 1 ----------\n" + TRACE.format("0x7fede8eacfe0")
           + "\n---------- rank 0 (consequence) ----------\n" + TRACE.format("0x7fede8eb9360")
           + "\n---------- rank 2 (consequence) ----------\nConnection closed by peer")


FOOTPRINT = {"rank": 1, "strategy": "FULL_SHARD", "shard_size": 2, "replicas": 1, "parameter_bytes": 67600,
             **{k: {"measured": 10, "unsharded": 20} for k in ("rest", "optimizer", "backward", "forward", "peak", "sent")}}


def _cell(nodeid, impl="fsdp", outcome="passed", **fields):
    return {"nodeid": nodeid, "phase": "call", "outcome": outcome, "family": "clip_grad", "layer": "api",
            "check": nodeid.split("::")[-1].split("[")[0], "impl": impl, "world_size": 2,
            "params": {"world_size": 2, "strategy": "FULL_SHARD"}, "duration_s": 0.25, "message": "",
            "rank_outcomes": {"0": "passed", "1": "passed"}, "max_abs_err": None, "max_rel_err": None,
            "tolerances": [], "expectation": None, "max_margin": None, "footprint": None, **fields}


def test_trim_groups_ranks_that_said_the_same_and_keeps_the_frames_a_reader_needs():
    text = texts.trim(MESSAGE)
    assert text.splitlines()[0] == MESSAGE.splitlines()[0]  # the headline the matrix shows, as it was
    assert "---------- rank 1 (the same: rank 0) ----------" in text
    assert "---------- rank 2 (consequence) ----------\nConnection closed by peer" in text
    block = text.split("----------\n")[1]
    assert block.splitlines() == [
        "Traceback (most recent call last):",
        '  File "shardcheck/conformance/checks/api/test_x.py", line 10, in test_x', "    model(batch)",
        '  File "torch/nn/modules/module.py", line 1778, in _wrapped_call_impl', "    return self._call_impl()",
        "  [... 2 frames cut by shardcheck ...]",
        '  File "torch/distributed/fsdp/_flat_param.py", line 1260, in init', "    shard.pin_memory()",
        "RuntimeError: no accelerator (object at 0x…)", "---------- rank 2 (consequence) "]
    assert "\n".join(texts.pieces(text)) == text and len(texts.pieces(text)) == 5
    assert texts.trim(text) == text  # trimming a trimmed text changes nothing


def test_trim_bounds_blocks_and_lines_and_leaves_other_texts_alone():
    assert texts.trim("unsupported: no offload") == "unsupported: no offload"
    long = "x" * 5000
    assert len(texts.trim(long)) <= texts.LINE_LIMIT
    blocks = "head\n---------- rank 0 ----------\n" + "\n".join(["y" * 300] * 20)
    assert len(texts.trim(blocks, 1024)) < 1024 + 100


def test_rows_give_back_the_cells():
    cells = [
        _cell("d/test_f.py::test_x[fsdp-ws2-FULL_SHARD]", max_abs_err=3.0517578125e-05, max_rel_err=0.0,
              tolerances=[[1.3e-06, 1e-05]], max_margin=0.123456),
        _cell("d/test_f.py::test_x[pkg.mod:FSDP-ws2-FULL_SHARD]", outcome="xfailed", message=texts.trim(MESSAGE),
              rank_outcomes={"0": "failed", "1": "passed", "2": "failed"},
              expectation={"reason": "why", "repro": "r.py", "finding": "F1"}),
        _cell("d/test_f.py::test_x[ws2-FULL_SHARD-fsdp]", outcome="unsupported", phase="setup",
              message="unsupported: no", rank_outcomes={}),
        _cell("d/test_g.py::test_plain", impl=None, params={}, world_size=None, max_rel_err="nan"),
        _cell("d/test_f.py::test_x[other-ws2-FULL_SHARD]", impl="other", outcome="error", phase="teardown"),
        _cell("d/test_sharding.py::test_sharding[fsdp-ws2-FULL_SHARD]", footprint=FOOTPRINT),
    ]
    encoded = compact.encode(cells, IMPLS, texts.pieces)
    rows = encoded["cells"]
    assert rows[0] == [0, 0, "passed", 0.25, None, None, 2, 3.052e-05, 0.0, 0, None, None, 0.1235]
    assert rows[1][:3] == [0, 1, "xfailed"] and rows[1][6] == {"0,2": "failed", "1": "passed"}
    assert rows[2][-1] == "d/test_f.py::test_x[ws2-FULL_SHARD-fsdp]"  # not spelled [<impl id>-<case>]
    assert rows[5][-1] == FOOTPRINT  # the family sharding's figures, the last column (version 5)
    assert len(encoded["cases"]) == 5 and encoded["cases"][0] == [0, "ws2-FULL_SHARD", 2, "FULL_SHARD"]
    report = {"implementations": IMPLS, **encoded}
    expected = copy.deepcopy(cells)
    expected[0]["max_abs_err"], expected[0]["max_margin"] = 3.052e-05, 0.1235  # to 4 significant digits
    assert compact.decode(report) == expected


def _v3(cells):
    head = {"suite": {"name": "shardcheck", "version": "0.1.0", "git_revision": None},
            "started": "2026-01-01T00:00:00+00:00", "implementations": IMPLS,
            "target": {"backends": ["gloo"], "device_type": "cpu", "device_model": "x86_64", "world_sizes": "all",
                       "torch": "2.13.0", "cuda": None, "nccl": None, "python": "3.11.7", "platform": "Linux",
                       "env": {}},
            "finished": "2026-01-01T00:00:01+00:00", "duration_s": 1.0, "complete": True, "exit_status": 0}
    return reporting.compose(head, cells, "r.jsonl")


def test_a_version_3_report_validates_and_its_indices_must_point_into_its_tables():
    report = _v3([_cell("d/test_f.py::test_x[fsdp-ws2-FULL_SHARD]", outcome="failed", message=MESSAGE)])
    assert reading.validate(report) is None
    assert reading.expand(report)["cells"][0]["message"] == texts.trim(MESSAGE)
    broken = copy.deepcopy(report)
    broken["cells"][0][5] = [0, 99]
    assert reading.validate(broken) == "$.cells[0][5]: text 99 is past the end of texts"
    broken = copy.deepcopy(report)
    broken["cases"][0].append("extra")
    assert reading.validate(broken) == "$.cases[0]: 3 values for the test's 2 params"


def test_writing_a_report_puts_a_row_on_a_line(tmp_path):
    report = _v3([_cell(f"d/test_f.py::test_x[fsdp-ws{n}-FULL_SHARD]") for n in range(1, 12)])
    reporting.write(report, tmp_path / "r.json")
    lines = (tmp_path / "r.json").read_text().splitlines()
    assert lines[0] == "{" and lines[1] == '"schema_version": 7,' and ' [0,0,"passed",0.25,null,null,2],' in lines
    assert json.loads((tmp_path / "r.json").read_text()) == report


@pytest.mark.skipif(not COMMITTED.is_file(), reason="no committed report")
def test_the_committed_report_as_version_3_is_a_tenth_of_version_2_and_shows_the_same(tmp_path, capsys):
    """`shardcheck report upgrade reports/cpu-gloo.json -o OUT` measures it too."""
    from shardcheck.conformance.cli import main as cli

    out = tmp_path / "cpu-gloo.json"
    assert cli.main(["report", "upgrade", str(COMMITTED), "-o", str(out)]) == 0
    assert f"written as version {reading.SCHEMA_VERSION}" in capsys.readouterr().out
    old, new = reading.load(COMMITTED), reading.load(out)
    if old["schema_version"] < 3:
        assert out.stat().st_size <= COMMITTED.stat().st_size / 10
    assert out.stat().st_size <= 300 * 1024  # issue 14's target
    assert matrix.markdown([new]) == matrix.markdown([old])
    assert [(c["nodeid"], c["outcome"], c["rank_outcomes"], c["expectation"]) for c in new["cells"]] == \
        [(c["nodeid"], c["outcome"], c["rank_outcomes"], c["expectation"]) for c in old["cells"]]


SPLIT = {"part": 2, "of": 3, "selection": "0123456789abcdef", "plan": "fedcba9876543210", "cells": 9, "timed": 7}


def test_version_7_adds_an_optional_split_and_reads_version_6_as_it_was(tmp_path, capsys):
    """Version 7 = version 6 with `split` (report/split.py); a version 6 report is read, and `report
    upgrade` rewrites it as version 7 without one (it was not split)."""
    from shardcheck.conformance.cli import main as cli

    cells = [_cell(f"d/test_f.py::test_x[fsdp-ws{n}-FULL_SHARD]") for n in (2, 4)]
    part = reporting.compose({**_v3(cells), "split": SPLIT}, cells, "r.jsonl")
    assert part["schema_version"] == 7 and part["split"] == SPLIT and reading.validate(part) is None
    assert reading.expand(part)["split"] == SPLIT  # load keeps it
    both = {**part, "split": {**SPLIT, "parts": []}}
    assert reading.validate(both) is not None  # a part or a merge, never both
    v6 = {k: v for k, v in _v3(cells).items() if k != "split"}
    v6["schema_version"] = 6
    assert reading.validate(v6) is None and reading.validate({**v6, "split": SPLIT}).startswith("$")
    (tmp_path / "v6.json").write_text(json.dumps(v6))
    assert cli.main(["report", "upgrade", str(tmp_path / "v6.json"), "-o", str(tmp_path / "v7.json")]) == 0
    assert "(schema version 6," in capsys.readouterr().out
    upgraded = reading.load(tmp_path / "v7.json")
    assert upgraded["schema_version"] == 7 and "split" not in upgraded
    assert [(c["nodeid"], c["outcome"]) for c in upgraded["cells"]] == [(c["nodeid"], c["outcome"]) for c in cells]
