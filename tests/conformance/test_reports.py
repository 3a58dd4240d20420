"""Reports: the JSON schema holds for what the writer emits, `shardcheck matrix` renders merged
reports as Markdown (the HTML page: test_report_html.py), and `shardcheck diff` finds regressions."""

import copy
import json
from pathlib import Path

import jsonschema
import pytest

import report_samples as samples
import warm_python
from shardcheck.conformance.cli import main as cli
from shardcheck.conformance.protocol.outcomes import OUTCOMES
from shardcheck.conformance.report import coverage, diff, matrix, reading

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def real_report(tmp_path_factory):
    """A report written by a real `shardcheck run` on a tiny subset (a few seconds)."""
    out = tmp_path_factory.mktemp("run") / "r.json"
    proc = warm_python.run(["-m", "shardcheck.conformance.cli", "run", "--family", "comm_hooks",
                            "-k", "default_communication_hook_behavior", "--world-sizes", "2", "-o", str(out)],
                           cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text())


# ---- schema -----------------------------------------------------------------------------------

@pytest.mark.parametrize("version", [2, 3, 4, 5, 6, 7])
def test_schema_is_draft_2020_12_and_versioned(version):
    schema = json.loads(reading.SCHEMAS[version].read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["$id"].endswith(f"/v{version}.json")
    assert schema["properties"]["schema_version"] == {"const": version}
    assert reading.SCHEMAS[reading.SCHEMA_VERSION] == matrix.SCHEMA


def test_a_real_report_validates(real_report):
    jsonschema.validate(real_report, json.loads(matrix.SCHEMA.read_text()),
                        cls=jsonschema.Draft202012Validator)
    assert matrix.validate(real_report) is None
    assert real_report["full_text"] == "r.jsonl" and len(real_report["cells"]) == 3
    assert {c["outcome"] for c in reading.expand(real_report)["cells"]} == {"passed"}


def test_hand_made_reports_are_valid():
    assert matrix.validate(samples.report([samples.cell("a", "test_x", o) for o in OUTCOMES])) is None


def _set(path, value):
    def mutate(report):
        *parents, last = path
        for key in parents:
            report = report[key]
        if value is KeyError:
            del report[last]
        else:
            report[last] = value
    return mutate


@pytest.mark.parametrize("mutate, where", [
    (_set(("cells", 0, 2), "exploded"), "$.cells[0][2]"),
    (_set(("cells", 0), [0, 0]), "$.cells[0]"),
    (_set(("target", "env", "AWS_SECRET_ACCESS_KEY"), "x"), "$.target.env"),
    (_set(("summary", "by_outcome", "passed"), "3"), "$.summary.by_outcome.passed"),
    (_set(("started",), KeyError), "$"),
    (_set(("cells", 0), [0, 0, "passed", 0.1, None, None, 2, None, None, None, None, None, None, None, "surprise"]),
     "$.cells[0]"),
    (_set(("full_text",), KeyError), "$"),
], ids=["bad-outcome", "short-row", "unlisted-env-variable", "count-not-int",
        "missing-top-field", "unknown-column", "no-full-text-field"])
def test_a_mutated_report_fails_validation(real_report, mutate, where):
    report = copy.deepcopy(real_report)
    mutate(report)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(report, json.loads(matrix.SCHEMA.read_text()), cls=jsonschema.Draft202012Validator)
    assert matrix.validate(report).startswith(where + ":")


def test_another_schema_version_is_one_clear_line(tmp_path, capsys):
    path = samples.write(tmp_path, "v8.json", {**samples.report([]), "schema_version": 8})
    assert cli.main(["matrix", path]) == 2
    err = capsys.readouterr().err
    assert err == (f"shardcheck: {path}: not a shardcheck report: schema version 8; this shardcheck reads "
                   "versions 1, 2, 3, 4, 5, 6, 7\n")


def test_a_version_1_report_is_read_as_version_2(real_report):
    v1 = samples.report([samples.cell("a", "test_x", "passed"), samples.cell("a", "test_y", "unsupported", family="train_parity")])
    report = reading.upgrade(v1)
    assert report["schema_version"] == 2 and v1["schema_version"] == 1  # a copy
    assert [c["layer"] for c in report["cells"]] == ["api", "behaviour"]
    assert report["summary"]["by_impl"]["a"]["behaviour"] == {"collected": 1, "reached": 0, "passed": 0,
                                                             "coverage": 0.0, "conformance": None}
    assert matrix.validate(report) is None and matrix.validate(v1) is None
    assert real_report["schema_version"] == 7 and "split" not in real_report  # an unsplit run
    from shardcheck.conformance.expectations import judged_releases  # the line the run printed, or null

    assert real_report["target"]["unjudged"] == judged_releases.unjudged(real_report["target"]["torch"], ["reference"])
    assert {c["layer"] for c in reading.expand(real_report)["cells"]} == {"api"}
    assert real_report["summary"]["by_impl"]["reference"]["api"]["coverage"] == 100.0


def test_unreadable_or_invalid_input_is_one_clear_line(tmp_path, capsys):
    (tmp_path / "bad.json").write_text("{not json")
    assert cli.main(["diff", str(tmp_path / "missing.json"), str(tmp_path / "bad.json")]) == 2
    missing = tmp_path / "missing.json"
    assert capsys.readouterr().err == f"shardcheck: {missing}: cannot read: No such file or directory\n"
    assert cli.main(["matrix", str(tmp_path / "bad.json")]) == 2
    assert capsys.readouterr().err.count("\n") == 1


# ---- matrix -----------------------------------------------------------------------------------

def test_rates_leave_out_unsupported_and_skipped_and_count_xfailed_as_not_passed(tmp_path):
    reports = [matrix.load(p) for p in samples.two_runs(tmp_path)]
    families, columns, counts = matrix.tabulate(matrix.merge(reports))
    assert families == ["clip_grad", "comm_hooks", "all"] and columns == ["reference", "torch-fsdp2"]
    assert matrix.rate(counts["clip_grad", "reference"]) == 100.0
    assert matrix.rate(counts["clip_grad", "torch-fsdp2"]) == 50.0  # 1 passed of passed + xfailed
    assert matrix.rate(counts["comm_hooks", "torch-fsdp2"]) == 0.0
    assert matrix.rate(counts["all", "torch-fsdp2"]) == 25.0


@pytest.mark.parametrize("version", [1, 2, 3, 4, 5, 6, 7])
def test_matrix_markdown_on_stdout(tmp_path, capsys, version):
    assert cli.main(["matrix", *samples.two_runs(tmp_path, version)]) == 0
    out = capsys.readouterr().out
    assert "| family | reference | torch-fsdp2 |" in out
    assert "| reference | api | **100.0% (5/5)** | 100.0% (5/5) | 5 passed |" in out
    assert ("| torch-fsdp2 | api | **66.7% (4/6)** | 25.0% (1/4) | 1 passed, 1 failed, 1 error, 1 xfailed, "
            "1 unsupported, 1 skipped |") in out
    assert ("| clip_grad | **100.0%** 4 passed | **50.0%** 1 passed, 1 xfailed, 1 unsupported, 1 skipped |"
            in out)
    assert "| **all** | **100.0%** 5 passed | **25.0%** 1 passed, 1 failed, 1 error, 1 xfailed," in out
    assert "### Failing cells (2)" in out
    assert ("| torch-fsdp2 | `test_comm_hooks.py::test_h[ws2-FULL_SHARD]` | AssertionError: grads: 2 mismatch(es) |"
            in out)
    assert "| torch-fsdp2 | `test_comm_hooks.py::test_h2[ws2-FULL_SHARD]` | rank 1 died: SIGSEGV |" in out


def test_same_impl_on_two_backends_gets_two_columns_and_a_rerun_replaces_a_cell(tmp_path):
    gloo = samples.report([samples.cell("reference", "test_c0", "failed")])
    gloo_rerun = samples.report([samples.cell("reference", "test_c0", "passed")], day=2)
    threaded = samples.report([samples.cell("reference", "test_c0", "passed")], backends=("threaded",))
    cells = matrix.merge([gloo_rerun, gloo, threaded])
    assert {k: c["outcome"] for k, c in cells.items()} == {
        ("reference (gloo)", "test_clip_grad.py::test_c0[ws2-FULL_SHARD]"): "passed",
        ("reference (threaded)", "test_clip_grad.py::test_c0[ws2-FULL_SHARD]"): "passed"}


def test_merge_a_verdict_beats_no_verdict_then_the_newer_run_whatever_the_order(tmp_path, capsys):
    old = samples.report([samples.cell("reference", "test_c0", "passed"), samples.cell("reference", "test_c1", "failed"),
                   samples.cell("reference", "test_c2", "skipped")], day=1)
    new = samples.report([samples.cell("reference", "test_c0", "skipped"), samples.cell("reference", "test_c1", "passed"),
                   samples.cell("reference", "test_c2", "unsupported")], day=2)
    want = {"test_c0": "passed", "test_c1": "passed", "test_c2": "unsupported"}
    for order in ([old, new], [new, old]):
        conflicts = []
        cells = matrix.merge(order, conflicts)
        assert {cid.split("::")[1].split("[")[0]: c["outcome"] for (_, cid), c in cells.items()} == want
        assert sorted((cid.split("::")[1][:7], kept["outcome"], dropped["outcome"])
                      for _, cid, kept, _, dropped, _ in conflicts) == [
            ("test_c0", "passed", "skipped"), ("test_c1", "passed", "failed"),
            ("test_c2", "unsupported", "skipped")]
    a, b = samples.write(tmp_path, "a.json", old), samples.write(tmp_path, "b.json", new)
    printed = []
    for args in ([a, b], [b, a]):
        assert cli.main(["matrix", *args]) == 0
        out, err = capsys.readouterr()
        printed.append(out)
        assert f"test_c0[ws2-FULL_SHARD]: passed ({a}) over skipped ({b})" in err
    assert printed[0] == printed[1]


def test_the_failure_message_under_xdist_is_the_failures_not_the_workers_line():
    text = "[gw1] linux -- Python 3.11.7 /venv/bin/python\nrank 0: AssertionError: step 0 loss\n"
    assert matrix.first_line(text) == "rank 0: AssertionError: step 0 loss"


@pytest.mark.parametrize("nodeid, selected_as, expected", [
    ("d/test_f.py::test_x[myimpl-ws2-A]", "myimpl", "test_f.py::test_x[ws2-A]"),
    ("d/test_f.py::test_x[ws2-myimpl-A]", "myimpl", "test_f.py::test_x[ws2-A]"),
    ("d/test_f.py::test_x[ws2-myimpl]", "myimpl", "test_f.py::test_x[ws2]"),
    ("d/test_f.py::test_x[pkg.mod:Cls]", "pkg.mod:Cls", "test_f.py::test_x"),
    ("d/test_f.py::test_plain", "myimpl", "test_f.py::test_plain"),
])
def test_cell_id_drops_the_implementation_like_the_manifests(nodeid, selected_as, expected):
    report = samples.report([])
    report["implementations"] = [{"name": "fake", "selected_as": selected_as}]
    assert matrix.cell_id(report, {"nodeid": nodeid, "impl": "fake"}) == expected


# ---- diff -------------------------------------------------------------------------------------

def _old_new(tmp_path, old_version=1, new_version=1):
    old = samples.report([samples.cell("a", "test_keep", "passed"), samples.cell("a", "test_breaks", "passed"),
                   samples.cell("a", "test_known", "xfailed"), samples.cell("a", "test_fixed", "failed"),
                   samples.cell("a", "test_dropped_cap", "passed"), samples.cell("a", "test_gone", "passed")])
    new = samples.report([samples.cell("a", "test_keep", "passed"), samples.cell("a", "test_breaks", "failed", message="E   boom"),
                   samples.cell("a", "test_known", "error", message="rank 0 hung"), samples.cell("a", "test_fixed", "passed"),
                   samples.cell("a", "test_dropped_cap", "unsupported"), samples.cell("a", "test_new", "failed")])
    return samples.write(tmp_path, "old.json", old, old_version), samples.write(tmp_path, "new.json", new, new_version)


def test_diff_buckets_every_change(tmp_path):
    old, new = (matrix.load(p) for p in _old_new(tmp_path))
    changes = {(c.kind, c.cell.split("::")[1].split("[")[0], c.old, c.new) for c in diff.diff(old, new)}
    assert changes == {("regressed", "test_breaks", "passed", "failed"),
                       ("regressed", "test_known", "xfailed", "error"),
                       ("fixed", "test_fixed", "failed", "passed"),
                       ("changed", "test_dropped_cap", "passed", "unsupported"),
                       ("appeared", "test_new", None, "failed"),
                       ("vanished", "test_gone", "passed", None)}


@pytest.mark.parametrize("old_version, new_version", [(1, 1), (2, 3), (3, 4), (4, 5), (5, 2), (5, 6), (6, 7), (7, 7)])
def test_diff_exits_1_on_a_regression_and_prints_the_table(tmp_path, capsys, monkeypatch, old_version, new_version):
    monkeypatch.setenv("COLUMNS", "200")
    assert cli.main(["diff", *_old_new(tmp_path, old_version, new_version)]) == 1
    out = capsys.readouterr().out
    assert "test_clip_grad.py::test_breaks[ws2-FULL_SHARD]" in out and "boom" in out
    assert out.rstrip().endswith("2 regressed, 1 fixed, 1 changed, 1 appeared, 1 vanished")


def test_diff_exits_0_without_regression(tmp_path, capsys):
    old = samples.write(tmp_path, "old.json", samples.report([samples.cell("a", "test_x", "failed"), samples.cell("a", "test_y", "passed")]))
    new = samples.write(tmp_path, "new.json", samples.report([samples.cell("a", "test_x", "passed"), samples.cell("a", "test_z", "failed")]))
    assert cli.main(["diff", old, new]) == 0
    assert capsys.readouterr().out.rstrip().endswith("0 regressed, 1 fixed, 0 changed, 1 appeared, 1 vanished")
    assert cli.main(["diff", old, old]) == 0


# ---- coverage and known failures ----------------------------------------------------------------

def _thin_and_known(tmp_path):
    """ddp reached 6 of 354 cells (all passed); fsdp2 has two findings' xfails and a behaviour layer."""
    ddp = [samples.cell("ddp", f"test_t{i}", "passed", family="train_parity") for i in range(6)]
    ddp += [samples.cell("ddp", f"test_c{i}", "unsupported") for i in range(348)]
    fsdp = [samples.cell("torch-fsdp2", "test_t0", "passed", family="train_parity")]
    for i, (finding, repro) in enumerate([("F9", "shardcheck/conformance/expectations/repros/a.py"),
                                          ("F9", "shardcheck/conformance/expectations/repros/a.py"),
                                          ("F10", "shardcheck/conformance/expectations/repros/b.py")]):
        cell = samples.cell("torch-fsdp2", f"test_k{i}", "xfailed", message="E   known")
        cell["expectation"] = {"reason": f"why {finding}", "repro": repro, "finding": finding}
        fsdp.append(cell)
    flat = [samples.cell("torch-fsdp1[flat]", "test_c0", "passed")]
    return samples.write(tmp_path, "thin.json", samples.report(ddp + fsdp + flat))


def test_matrix_rows_are_implementation_x_layer_with_coverage_beside_conformance(tmp_path, capsys):
    assert cli.main(["matrix", _thin_and_known(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| ddp | behaviour | **100.0% (6/6)** | 100.0% (6/6) | 6 passed |" in out
    assert "| ddp | api | **0.0% (0/348)** | n/a (0/0) | 348 unsupported |" in out
    assert "| ddp | **all** | **1.7% (6/354)** | 100.0% (6/6) |" in out  # thin: not green
    assert "| torch-fsdp1[flat] | api | **100.0% (1/1)** |" in out  # a variant is its own row
    assert "| torch-fsdp2 | api | **100.0% (3/3)** | 0.0% (0/3) | 3 xfailed |" in out


def test_known_failures_are_grouped_by_finding_with_reason_and_reproduction(tmp_path, capsys):
    path = _thin_and_known(tmp_path)
    assert cli.main(["matrix", path]) == 0
    out = capsys.readouterr().out
    assert "### Known failures (3 cells, 2 findings)" in out
    f9, f10 = out.index("#### F9 · torch-fsdp2 · 2 cell(s)"), out.index("#### F10 · torch-fsdp2 · 1 cell(s)")
    assert f9 < f10  # in number order
    assert "why F9" in out[f9:f10] and "Reproduction: `shardcheck/conformance/expectations/repros/a.py`" in out[f9:f10]
    assert "- torch-fsdp2 `test_clip_grad.py::test_k1[ws2-FULL_SHARD]`" in out[f9:f10]
    page = tmp_path / "m.html"
    assert cli.main(["matrix", path, "--html", str(page)]) == 0
    text = page.read_text()
    assert "<h3>F10 · torch-fsdp2 · 1 cell(s) · bug</h3><p>why F10</p>" in text
    assert "<b>1.7%</b> (6/354)" in text


def test_conformance_counts_bugs_only_and_the_matrix_says_each_kind_apart(tmp_path, capsys):
    """Issue 61: a known failure that is by design (F48: judged by DDP's buffer broadcast), platform
    (F62) or misuse is set aside, neither passed nor failed; a known bug (F9) still counts against
    conformance. The kinds come from the manifests (expectations/kinds.py), not from the report."""
    cells = [samples.cell("torch-fsdp2", f"test_p{i}", "passed", family="train_parity") for i in range(2)]
    for i, finding in enumerate(["F9", "F48", "F48", "F62"]):
        cell = samples.cell("torch-fsdp2", f"test_k{i}", "xfailed", family="train_parity", message="E   known")
        cell["expectation"] = {"reason": f"why {finding}", "repro": "r.py", "finding": finding}
        cells.append(cell)
    path = samples.write(tmp_path, "kinds.json", samples.report(cells))
    assert cli.main(["matrix", path]) == 0
    out = capsys.readouterr().out
    # 6 reached, 3 set aside (2 by design, 1 platform): conformance 2 passed of 3 judged, not 2 of 6
    assert "| torch-fsdp2 | behaviour | **100.0% (6/6)** | 66.7% (2/3) | 2 passed, 1 xfailed, 2 by design, 1 platform |" in out
    assert "By kind (docs/findings.md): 1 bug, 1 by design, 1 platform. Conformance counts the bugs only." in out
    bugs, design, platform = (out.index("#### Bugs (1 cells)"), out.index("#### Set aside: by design (2 cells)"),
                              out.index("#### Set aside: platform (1 cells)"))
    assert bugs < design < platform
    assert ("##### F48 · torch-fsdp2 · 2 cell(s) · differs from DDP, by design "
            "(https://docs.pytorch.org/docs/stable/generated/torch.nn.parallel.DistributedDataParallel.html)") in out
    assert "##### F62 · torch-fsdp2 · 1 cell(s) · platform" in out
    page = tmp_path / "k.html"
    assert cli.main(["matrix", path, "--html", str(page)]) == 0
    text = page.read_text()
    assert "<b>66.7%</b> (2/3)" in text and "· differs from DDP, by design (https://docs.pytorch.org" in text
    # the JSON report's own summary keeps schema 6's tally: passed / reached, nothing set aside
    assert coverage.by_impl(cells)["torch-fsdp2"]["all"]["conformance"] == 33.33
    assert coverage.by_impl(cells, bugs_only=True)["torch-fsdp2"]["all"]["conformance"] == 66.67


def test_report_without_reports_of_its_layer_is_other():
    cells = [{"impl": "x", "family": "selftest", "outcome": "skipped"}]
    assert coverage.by_impl(cells) == {"x": {
        "other": {"collected": 1, "reached": 0, "passed": 0, "coverage": 0.0, "conformance": None},
        "all": {"collected": 1, "reached": 0, "passed": 0, "coverage": 0.0, "conformance": None}}}
    assert coverage.below(coverage.by_impl(cells), 50) == [
        "shardcheck: x: coverage 0.0% (0 of 1 cells reached a verdict) is below --min-coverage 50%"]


def test_every_committed_cell_is_a_typed_cell_record():
    """reading.Cell names what a loaded cell holds: every cell of every committed report under reports/
    has exactly its keys; and a key dropped from a cell is seen."""
    required = reading.Cell.__required_keys__
    assert required == set(reading.Cell.__annotations__) and not reading.Cell.__optional_keys__
    paths = sorted((ROOT / "reports").glob("*.json"))  # the releases/ reports are the same writer's
    assert paths
    for path in paths:
        for cell in reading.cells_of(reading.load(path)):
            assert set(cell) == required, (path, sorted(set(cell) ^ required))
            assert cell["outcome"] in OUTCOMES, (path, cell["nodeid"])
    cell = dict(reading.cells_of(reading.load(paths[0]))[0])
    del cell["footprint"]
    assert set(cell) != required
