"""The release axis: `shardcheck releases` (its pins, environments and runs) and the trend across
torch releases in `shardcheck matrix` (shardcheck/conformance/report/trend.py)."""

import json
import sys

import pytest
import torch

from shardcheck.conformance.cli import releases as command
from shardcheck.conformance.cli.main import main
from shardcheck.conformance.report import matrix, trend

from report_samples import cell, report, write


def on(torch_version, cells, day):
    r = report(cells, day=day)
    r["target"]["torch"] = torch_version
    return r


def known(impl, check, finding):
    c = cell(impl, check, "xfailed")
    c["expectation"] = {"finding": finding, "reason": f"{finding} reason", "repro": f"repros/{finding}.py"}
    return c


def releases_of(impl="torch-fsdp2"):
    """F1 known on 2.9.1, fixed in 2.10.0; F2 known on 2.9.1, fails unscoped on 2.10.0; a cell added
    in 2.10.0."""
    old = on("2.9.1+cu128", [known(impl, "test_a", "F1"), known(impl, "test_b", "F2"),
                             cell(impl, "test_c", "passed")], day=1)
    new = on("2.10.0+cpu", [cell(impl, "test_a", "passed"), cell(impl, "test_b", "failed"),
                            cell(impl, "test_c", "passed"), cell(impl, "test_new", "passed")], day=2)
    return [old, new]


def test_the_same_implementation_on_two_releases_gets_a_column_per_release():
    cells = matrix.merge(releases_of())
    assert {column for column, _ in cells} == {"torch-fsdp2 (torch 2.9.1)", "torch-fsdp2 (torch 2.10.0)"}
    assert set(matrix.column_sources(releases_of()).values()) == {("torch-fsdp2", ("2.9.1", "1")),
                                                                  ("torch-fsdp2", ("2.10.0", "1"))}


def test_one_release_keeps_the_plain_column_and_no_trend_section(tmp_path):
    one = [on("2.9.1+cu128", [cell("ddp", "test_a", "passed")], day=1),
           on("2.9.1+cpu", [cell("ddp", "test_b", "passed")], day=2)]
    assert {column for column, _ in matrix.merge(one)} == {"ddp"}
    assert "Across releases" not in matrix.markdown(one)


def test_counts_are_over_the_cells_every_release_collected_and_new_cells_apart():
    rels = trend.by_release(matrix.merge(releases_of()), matrix.column_sources(releases_of()))["torch-fsdp2"]
    assert list(rels) == ["torch 2.9.1", "torch 2.10.0"]  # version order, not string order
    per = trend.counts(rels)
    assert per["torch 2.9.1"] == ({"xfailed": 2, "passed": 1}, 0)
    assert per["torch 2.10.0"] == ({"passed": 2, "failed": 1}, 1)


def test_each_finding_gets_its_state_per_release_and_first_broken_and_fixed():
    rels = trend.by_release(matrix.merge(releases_of()), matrix.column_sources(releases_of()))["torch-fsdp2"]
    states = trend.findings(rels)
    assert states == {"F1": {"torch 2.9.1": "known", "torch 2.10.0": "passes"},
                      "F2": {"torch 2.9.1": "known", "torch 2.10.0": "FAILS"}}
    assert trend.first_broken_and_fixed(states["F1"]) == ("≤ torch 2.9.1", "torch 2.10.0")  # maybe broken before
    assert trend.first_broken_and_fixed(states["F2"]) == ("≤ torch 2.9.1", "–")
    assert trend.first_broken_and_fixed({"a": "passes", "b": "known", "c": "passes", "d": "FAILS"}) == ("b", "–")
    assert trend.first_broken_and_fixed({"a": "–", "b": "passes"}) == ("–", "–")


def test_matrix_markdown_shows_the_trend(tmp_path, capsys):
    paths = [write(tmp_path, f"r{i}.json", r) for i, r in enumerate(releases_of())]
    assert main(["matrix", *paths]) == 0
    out = capsys.readouterr().out
    assert "### Across releases" in out
    assert "| F1 | known | passes | ≤ torch 2.9.1 | torch 2.10.0 |" in out
    assert "| F2 | known | FAILS | ≤ torch 2.9.1 | – |" in out
    assert "| torch 2.10.0 | 2 passed, 1 failed | +1 |" in out


def test_an_engine_on_two_of_its_own_releases_gets_a_column_and_a_trend_per_release():
    """Accelerate 1.13.0 and 1.15.0 on the same torch: the engine's own release is the axis."""
    def acc(version, outcome, day):
        r = on("2.13.0+cpu", [known("accelerate", "test_a", "F28") if outcome == "xfailed"
                              else cell("accelerate", "test_a", outcome)], day=day)
        r["implementations"][0]["version"] = version
        return r
    runs = [acc("1.15.0", "xfailed", 1), acc("1.13.0", "passed", 2)]
    assert {column for column, _ in matrix.merge(runs)} == {"accelerate (1.13.0)", "accelerate (1.15.0)"}
    rels = trend.by_release(matrix.merge(runs), matrix.column_sources(runs))["accelerate"]
    assert list(rels) == ["1.13.0", "1.15.0"]
    assert trend.first_broken_and_fixed(trend.findings(rels)["F28"]) == ("1.15.0", "–")  # broken in 1.15.0


def test_pins_name_one_release_each_and_bad_pins_are_one_line(capsys):
    assert command.releases(["torch==2.9.1,2.14.1", "Accelerate==1.13.0"]) == [
        ("torch", "2.9.1"), ("torch", "2.14.1"), ("accelerate", "1.13.0")]
    for bad in ("torch=2.9", "torch==", "==2.9"):
        with pytest.raises(ValueError, match="expected PACKAGE==V1"):
            command.releases([bad])
    assert main(["releases", "torch>=2.9"]) == 2
    assert "expected PACKAGE==V1" in capsys.readouterr().err


def test_another_package_keeps_the_running_torch_and_shardcheck_comes_from_its_checkout():
    wanted = command.requirements("accelerate", "1.13.0", ["deepspeed==0.18.9"])
    assert wanted[:3] == ["accelerate==1.13.0", f"torch=={torch.__version__.split('+')[0]}", "deepspeed==0.18.9"]
    assert wanted[3] == "-e" and wanted[4].endswith("[explore]")
    assert command.requirements("torch", "2.9.1", [])[0] == "torch==2.9.1"
    assert not any(w.startswith("torch==2.1") for w in command.requirements("torch", "2.9.1", []))


def test_an_environment_is_made_once_and_remade_when_its_requirements_change(tmp_path, monkeypatch):
    calls = []

    def fake(argv):
        calls.append(argv)
        if argv[:2] == ["uv", "venv"]:
            (tmp_path / "torch-2.9.1" / "bin").mkdir(parents=True)
            (tmp_path / "torch-2.9.1" / "bin" / "python").touch()
    monkeypatch.setattr(command, "_call", fake)
    env = command.environment(tmp_path, "torch", "2.9.1", ["torch==2.9.1"], "uv")
    assert [c[:2] for c in calls] == [["uv", "venv"], ["uv", "pip"]] and calls[1][-1] == "torch==2.9.1"
    assert command.environment(tmp_path, "torch", "2.9.1", ["torch==2.9.1"], "uv") == env
    assert len(calls) == 2  # reused
    command.environment(tmp_path, "torch", "2.9.1", ["torch==2.9.1", "numpy"], "uv")
    assert len(calls) == 4  # remade
    monkeypatch.setattr(command, "_dependencies", lambda: "torch>=2.9;rich>=14")
    command.environment(tmp_path, "torch", "2.9.1", ["torch==2.9.1", "numpy"], "uv")
    assert len(calls) == 6  # shardcheck's own dependencies changed


def test_an_environment_that_cannot_be_made_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip fails at once, as it would on an index without it
    code = main(["releases", "torch==0.0.0.dev0", "--envs", str(tmp_path / "envs"), "-o", str(tmp_path / "out"),
                 "--installer", "pip"])
    assert code == 2
    err = capsys.readouterr().err
    assert "torch==0.0.0.dev0: no environment:" in err and len(err.strip().splitlines()) == 1


def _this_environment(monkeypatch):
    """Every release's environment is this one (no install): the run half of the command alone."""
    monkeypatch.setattr(command, "environment", lambda *a: type("Env", (), {
        "__truediv__": lambda self, part: __import__("pathlib").Path(sys.executable).parents[1] / part})())


def test_a_run_in_an_environment_writes_its_report_where_the_trend_reads_it(tmp_path, monkeypatch, capsys):
    _this_environment(monkeypatch)
    out = tmp_path / "releases"
    code = main(["releases", "torch==2.13.0", "-o", str(out), "--", "--world-sizes", "2", "-k", "test_non_root",
                 "--family", "clip_grad"])
    assert code == 0, capsys.readouterr()
    written = json.loads((out / "torch-2.13.0" / "reference.json").read_text())
    assert written["cells"] and trend.release(written, "reference")[0] == torch.__version__.split("+")[0]
    assert "torch==2.13.0 reference: exit 0" in capsys.readouterr().out


def test_a_run_that_writes_no_report_is_not_summed_up_by_an_earlier_one(tmp_path, monkeypatch, capsys):
    _this_environment(monkeypatch)
    stale = tmp_path / "releases" / "torch-2.13.0" / "reference.json"
    stale.parent.mkdir(parents=True)
    write(stale.parent, stale.name, releases_of()[0])
    code = main(["releases", "torch==2.13.0", "-o", str(tmp_path / "releases"), "--", "--world-sizes", "two"])
    assert code == 2 and not stale.exists()
    assert "torch==2.13.0 reference: exit 2; no report" in capsys.readouterr().out


def test_the_html_page_shows_the_trend_too():
    from shardcheck.conformance.report import page

    text = page.html_page(releases_of())
    assert "<h2>Across releases</h2>" in text and "<h3>torch-fsdp2 · 3 cells on every release</h3>" in text
    assert "<tr><th>F1</th><td>known</td><td>passes</td><td>≤ torch 2.9.1</td><td>torch 2.10.0</td></tr>" in text


def test_the_command_ends_with_the_trend_of_its_runs(tmp_path, capsys):
    paths = [tmp_path / f"r{i}.json" for i in range(2)]
    for path, r in zip(paths, releases_of()):
        write(tmp_path, path.name, r)
    command.print_trend(paths)
    out = capsys.readouterr().out
    assert "### Across releases" in out and "| F1 | known | passes | ≤ torch 2.9.1 | torch 2.10.0 |" in out
    command.print_trend(paths[:1])
    assert capsys.readouterr().out == ""  # one release: no trend


def test_a_prefixed_run_writes_beside_the_first_and_the_matrix_joins_them_in_one_column(tmp_path, monkeypatch, capsys):
    """--prefix: a second run of other cells on a release (the models family, which the default run
    leaves out) writes <prefix><impl>.json beside the release's <impl>.json, and `shardcheck matrix`
    reads the two as one implementation on one release: one column, no trend between them."""
    _this_environment(monkeypatch)
    out = tmp_path / "releases"
    code = main(["releases", "torch==2.13.0", "-o", str(out), "--prefix", "zoo-", "--", "--world-sizes", "2",
                 "-k", "test_non_root", "--family", "clip_grad"])
    assert code == 0, capsys.readouterr()
    release = out / "torch-2.13.0"
    assert sorted(p.name for p in release.glob("*.json")) == ["zoo-reference.json"]
    assert f"reference: exit 0; torch {torch.__version__}" in capsys.readouterr().out
    zoo = json.loads((release / "zoo-reference.json").read_text())
    first = on(zoo["target"]["torch"], [cell("reference", "test_first_run", "passed")], day=1)
    first["implementations"][0]["version"] = zoo["implementations"][0]["version"]
    write(release, "reference.json", first)
    from shardcheck.conformance.report.reading import load

    both = [load(release / "reference.json"), load(release / "zoo-reference.json")]
    cells = matrix.merge(both)
    assert {column for column, _ in cells} == {"reference"}
    assert any("test_first_run" in cid for _, cid in cells) and any("test_non_root" in cid for _, cid in cells)
    assert "Across releases" not in matrix.markdown(both)
