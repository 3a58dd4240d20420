"""`shardcheck run --split K/N` and `shardcheck report merge`: the split is a partition of the selected
cells, the same on every machine, balanced by recorded durations (by count without them); the parts'
reports merged give the unsplit run's cells and outcomes; a set of parts with one missing, repeated
or from another selection is refused in one line with its own exit status."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

import warm_python
from shardcheck.conformance.cli import exit_codes as codes
from shardcheck.conformance.cli import main as cli
from shardcheck.conformance.report import merge, reading, split
from shardcheck.conformance.report import writer as reporting

ROOT = Path(__file__).resolve().parents[2]
SHARDCHECK = [sys.executable, "-m", "shardcheck.conformance.cli"]
SELECTION = ("--family", "train_parity", "--world-sizes", "2")
# The end-to-end runs: 14 cells of two check functions, not the family's 42 at world size 2 (run
# three times over: whole and in two parts); a partition, a merge and a balance show on 14 as on 42.
RUN_SELECTION = (*SELECTION, "-k", "noclip or optimizer_parity")


def _keys(n: int) -> list[str]:
    return [f"test_f{i % 3}.py::test_x[reference-ws2-{i}]" for i in range(n)]


# ---- the split -----------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [("1/3", (1, 3)), (" 3 / 3 ", (3, 3)), ("1/1", (1, 1))])
def test_k_of_n_is_parsed(text, expected):
    assert (split.parse(text).part, split.parse(text).of) == expected


@pytest.mark.parametrize("text", ["0/3", "3/2", "x", "1/0", "-1/2", "1/2/3", ""])
def test_anything_but_k_of_n_is_refused(text):
    with pytest.raises(ValueError, match="is not K/N"):
        split.parse(text)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 40])
@pytest.mark.parametrize("timed", [False, True])
def test_every_cell_lands_in_exactly_one_part_the_same_whatever_the_order(n, timed):
    keys = _keys(31)
    rng = random.Random(n)
    durations = {k: rng.choice([0.0, 0.01, 0.5, 2.0, 7.5]) for k in keys[::2]} if timed else {}
    parts = split.plan(keys, durations, n)
    assert len(parts) == len(keys) and set(parts) <= set(range(1, n + 1))
    assert sorted(k for part in range(1, n + 1) for k, p in zip(keys, parts) if p == part) == sorted(keys)
    shuffled = keys[:]
    rng.shuffle(shuffled)  # another machine collecting in another order: each cell in the same part
    assert dict(zip(shuffled, split.plan(shuffled, durations, n))) == dict(zip(keys, parts))
    assert split.plan(keys, dict(durations), n) == parts  # deterministic


def test_without_durations_the_parts_differ_by_at_most_one_cell():
    for n in (2, 3, 5):
        sizes = [split.plan(_keys(23), {}, n).count(p) for p in range(1, n + 1)]
        assert max(sizes) - min(sizes) <= 1 and sum(sizes) == 23
    zero = split.plan(_keys(6), dict.fromkeys(_keys(6), 0.0), 3)  # timed at 0 s: spread by count
    assert sorted(zero.count(p) for p in (1, 2, 3)) == [2, 2, 2]


def test_with_durations_the_parts_take_about_the_same_time():
    keys = _keys(40)
    rng = random.Random(0)
    durations = {k: round(rng.uniform(0.01, 3.0), 3) for k in keys}
    durations[keys[0]] = 9.0  # one long cell
    for n in (2, 3, 4):
        loads = [sum(durations[k] for k, p in zip(keys, split.plan(keys, durations, n)) if p == part)
                 for part in range(1, n + 1)]
        # greedy longest-first: no part exceeds another by more than its longest cell
        assert max(loads) - min(loads) <= max(durations.values()), loads
    by_count = [sum(durations[k] for k, p in zip(keys, split.plan(keys, {}, 4)) if p == part) for part in range(1, 5)]
    balanced = [sum(durations[k] for k, p in zip(keys, split.plan(keys, durations, 4)) if p == part)
                for part in range(1, 5)]
    assert max(balanced) <= max(by_count)  # the durations help: the longest part is no longer than by count


def test_an_untimed_cell_weighs_the_mean_of_the_timed_ones():
    keys = ["a.py::t[1]", "a.py::t[2]", "a.py::t[3]", "a.py::t[new]"]
    parts = split.plan(keys, {"a.py::t[1]": 6.0, "a.py::t[2]": 2.0, "a.py::t[3]": 1.0}, 2)
    assert parts == [1, 2, 2, 2]  # the new cell weighs 3 s: beside the 2 s and 1 s cells, not the 6 s one


def test_a_cell_is_keyed_by_its_file_name_wherever_the_suite_lives():
    assert split.key("shardcheck/conformance/checks/api/test_x.py::test_y[reference-ws2]") == \
        split.key("../site-packages/shardcheck/conformance/checks/api/test_x.py::test_y[reference-ws2]") == \
        "test_x.py::test_y[reference-ws2]"


def test_the_record_fingerprints_the_selection_and_the_plan():
    keys = _keys(9)
    one = split.record(split.Split(1, 3), keys, split.plan(keys, {}, 3), {})
    two = split.record(split.Split(2, 3), list(reversed(keys)), split.plan(list(reversed(keys)), {}, 3), {})
    assert (one["selection"], one["plan"], one["cells"], one["timed"]) == (two["selection"], two["plan"], 9, 0)
    other = split.record(split.Split(1, 3), keys[:-1], split.plan(keys[:-1], {}, 3), {})
    assert other["selection"] != one["selection"]
    timed = {keys[0]: 9.0, keys[3]: 8.0, keys[6]: 1.0}
    replanned = split.record(split.Split(1, 3), keys, split.plan(keys, timed, 3), timed)
    assert replanned["selection"] == one["selection"] and replanned["plan"] != one["plan"] and replanned["timed"] == 3


# ---- merge ---------------------------------------------------------------------------------------

def _cell(i: int, outcome: str = "passed") -> dict:
    nodeid = f"shardcheck/conformance/checks/behaviour/test_train_parity.py::test_p[reference-ws2-{i}]"
    return {"nodeid": nodeid, "phase": "call", "outcome": outcome, "family": "train_parity", "layer": "behaviour",
            "check": "test_p", "impl": "reference", "world_size": 2, "params": {"world_size": 2, "i": i},
            "duration_s": 0.5 + i, "message": "", "rank_outcomes": {"0": "passed", "1": "passed"},
            "max_abs_err": None, "max_rel_err": None, "tolerances": [], "expectation": None, "max_margin": None,
            "footprint": None}


def _head(day: int = 1) -> dict:
    return {"suite": {"name": "shardcheck", "version": "0.1.0", "git_revision": None},
            "started": f"2026-01-0{day}T00:00:00+00:00", "finished": f"2026-01-0{day}T00:00:05+00:00",
            "duration_s": 5.0, "complete": True, "exit_status": 0,
            "implementations": [{"name": "reference", "selected_as": "reference", "version": "1",
                                 "adapter": "m:A", "capabilities": []}],
            "target": {"backends": ["gloo"], "device_type": "cpu", "device_model": "x86_64", "world_sizes": [2],
                       "torch": "2.13.0", "cuda": None, "nccl": None, "python": "3.11.7", "platform": "Linux",
                       "env": {}, "unjudged": None}}


def _parts(tmp_path: Path, n: int, cells: list[dict], durations: dict | None = None) -> list[str]:
    """The reports of the n parts of a run of `cells`, as the writer would write them."""
    keys = [split.key(c["nodeid"]) for c in cells]
    durations = durations or {}
    parts = split.plan(keys, durations, n)
    paths = []
    for part in range(1, n + 1):
        mine = [c for c, p in zip(cells, parts) if p == part]
        record = split.record(split.Split(part, n), keys, parts, durations)
        path = tmp_path / f"part{part}-of{n}{'-timed' if durations else ''}.json"
        reporting.write(reporting.compose({**_head(part), "split": record}, mine, None), path)
        paths.append(str(path))
    return paths


def test_merged_parts_hold_every_cell_once_with_the_summary_over_them_all(tmp_path, capsys):
    cells = [_cell(i, "failed" if i == 4 else "passed") for i in range(7)]
    paths = _parts(tmp_path, 3, cells)
    out = tmp_path / "merged" / "m.json"
    assert cli.main(["report", "merge", *reversed(paths), "-o", str(out)]) == codes.OK  # any order
    assert "7 cells of 7 from 3 parts: 1 failed, 6 passed; complete: true" in capsys.readouterr().out
    merged = reading.load(out)
    assert sorted((c["nodeid"], c["outcome"]) for c in merged["cells"]) == sorted((c["nodeid"], c["outcome"]) for c in cells)
    assert merged["summary"]["by_outcome"] == {"passed": 6, "failed": 1}
    assert merged["summary"]["by_impl"]["reference"]["all"]["collected"] == 7
    assert merged["complete"] and merged["exit_status"] == 0
    held = merged["split"]
    assert [p["part"] for p in held["parts"]] == [1, 2, 3] and held["of"] == 3 and held["cells"] == 7
    assert [p["report"] for p in held["parts"]] == [f"../part{k}-of3.json" for k in (1, 2, 3)]
    assert sum(p["cells"] for p in held["parts"]) == 7
    assert merged["started"] == "2026-01-01T00:00:00+00:00" and merged["finished"] == "2026-01-03T00:00:05+00:00"


def test_a_merge_of_an_incomplete_part_is_incomplete(tmp_path):
    cells = [_cell(i) for i in range(4)]
    paths = _parts(tmp_path, 2, cells)
    report = reading.load(paths[1])
    report["complete"], report["exit_status"] = False, None
    cut = [c for c in report["cells"]][1:]  # a cell the interrupted part never finished
    reporting.write(reporting.compose(report, cut, None), Path(paths[1]))
    merged = merge.merge([(p, reading.load(p)) for p in paths], tmp_path / "m.json")
    assert merged["complete"] is False and merged["exit_status"] is None and len(merged["cells"]) == 3


def _refused(args, capsys, *words) -> str:
    assert cli.main(["report", "merge", *args]) == codes.PARTS
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("shardcheck report merge: ") and "Traceback" not in err, err
    assert all(w in err for w in words), err
    return err


def test_a_missing_part_a_repeated_part_or_another_selection_is_refused_in_one_line(tmp_path, capsys):
    cells = [_cell(i) for i in range(6)]
    one, two, three = _parts(tmp_path, 3, cells)
    out = tmp_path / "m.json"
    _refused([one, three, "-o", str(out)], capsys, "part 2 of 3 missing (given: 1, 3)")
    _refused([one, two, two, three, "-o", str(out)], capsys, "part 2/3 given twice")
    (tmp_path / "other").mkdir()
    other = _parts(tmp_path / "other", 3, cells[:5])
    _refused([one, two, other[2], "-o", str(out)], capsys, "of another selection (5 cells", "than")
    durations = {split.key(c["nodeid"]): seconds for c, seconds in zip(cells, (9.0, 8.0, 1.0))}
    assert split.plan([split.key(c["nodeid"]) for c in cells], durations, 3) != \
        split.plan([split.key(c["nodeid"]) for c in cells], {}, 3)  # other durations, another plan
    timed = _parts(tmp_path, 3, cells, durations)
    _refused([one, two, timed[2], "-o", str(out)], capsys, "split the same cells differently")
    assert not out.exists()  # nothing written
    assert cli.main(["report", "merge", one, two, three, "-o", str(out)]) == codes.OK
    _refused([str(out), "-o", str(tmp_path / "again.json")], capsys, "a merged report", "not a part")


def test_an_unsplit_report_or_another_torch_is_refused(tmp_path, capsys):
    cells = [_cell(i) for i in range(4)]
    one, two = _parts(tmp_path, 2, cells)
    whole = tmp_path / "whole.json"
    reporting.write(reporting.compose(_head(), cells, None), whole)
    _refused([one, str(whole), "-o", str(tmp_path / "m.json")], capsys, "not a part of a split run")
    report = reading.load(two)
    report["target"] = {**report["target"], "torch": "2.9.1"}
    reporting.write(reporting.compose(report, report["cells"], None), Path(two))
    _refused([one, two, "-o", str(tmp_path / "m.json")], capsys, "another torch")


def test_a_part_that_is_not_a_report_is_a_usage_error(tmp_path, capsys):
    (tmp_path / "x.json").write_text("{}")
    assert cli.main(["report", "merge", str(tmp_path / "x.json"), "-o", str(tmp_path / "m.json")]) == codes.USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a shardcheck report" in err


@pytest.mark.parametrize("value", ["0/3", "3/2", "x"])
def test_a_bad_split_is_one_usage_line(value, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["run", *SELECTION, "--split", value])
    err = capsys.readouterr().err
    assert exit_.value.code == codes.USAGE and err.count("\n") == 1
    assert err.startswith(f"shardcheck run: argument --split: {value!r} is not K/N"), err


def test_durations_that_cannot_be_read_are_one_usage_line(tmp_path, capsys):
    assert cli.main(["run", *SELECTION, "--split", "1/2", "--durations", str(tmp_path / "none.json"),
                     "-o", str(tmp_path / "r.json")]) == codes.USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--durations" in err and "cannot read" in err
    assert cli.main(["run", *SELECTION, "--durations", str(tmp_path / "none.json")]) == codes.USAGE
    assert "give --split K/N too" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


# ---- end to end ----------------------------------------------------------------------------------

def _shardcheck(*args: str) -> warm_python.Completed:
    return warm_python.run([*SHARDCHECK[1:], *args], cwd=ROOT, timeout=300)


def test_parts_run_and_merged_give_the_unsplit_runs_cells_and_outcomes(tmp_path):
    whole = tmp_path / "whole.json"
    proc = _shardcheck("run", *RUN_SELECTION, "-o", str(whole))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    parts = []
    for k in (1, 2):
        parts.append(tmp_path / f"part{k}.json")
        proc = _shardcheck("run", *RUN_SELECTION, "--split", f"{k}/2", "-o", str(parts[-1]))
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    unsplit = reading.load(whole)
    assert len(unsplit["cells"]) == 14 and len({c["nodeid"].partition("[")[0] for c in unsplit["cells"]}) == 2
    halves = [reading.load(p) for p in parts]
    assert all(h["split"]["cells"] == len(unsplit["cells"]) and h["split"]["of"] == 2 for h in halves)
    assert all(0 < len(h["cells"]) < len(unsplit["cells"]) for h in halves)
    assert halves[0]["split"]["timed"] > 0  # balanced by the committed report's durations
    merged_path = tmp_path / "merged.json"
    proc = _shardcheck("report", "merge", *map(str, parts), "-o", str(merged_path))
    assert proc.returncode == 0 and f"report written to {merged_path}" in proc.stdout, proc.stderr
    merged = reading.load(merged_path)
    assert sorted((c["nodeid"], c["outcome"]) for c in merged["cells"]) == \
        sorted((c["nodeid"], c["outcome"]) for c in unsplit["cells"])
    assert merged["summary"]["by_outcome"] == unsplit["summary"]["by_outcome"]
    assert merged["summary"]["by_impl"] == unsplit["summary"]["by_impl"]
    assert merged["complete"] and [p["part"] for p in merged["split"]["parts"]] == [1, 2]
    missing = _shardcheck("report", "merge", str(parts[0]), "-o", str(tmp_path / "m.json"))
    assert missing.returncode == codes.PARTS and missing.stderr.strip() == \
        "shardcheck report merge: part 2 of 2 missing (given: 1)"


def test_the_pytest_option_splits_a_plain_session_and_refuses_a_bad_value(tmp_path):
    """`pytest --shardcheck-split K/N` straight from pytest (no shardcheck run): the parts' nodeids
    partition the session's."""
    test = tmp_path / "test_plain.py"
    test.write_text("import pytest\n\n@pytest.mark.parametrize('i', range(7))\ndef test_i(i):\n    assert i >= 0\n")

    def collected(*extra):
        proc = warm_python.run(["-m", "pytest", "--co", "-q", "-p", "no:cacheprovider", str(test), *extra],
                               cwd=tmp_path, timeout=120)
        return proc, [line for line in proc.stdout.splitlines() if "::" in line]

    _, every = collected("--shardcheck-world-sizes", "2")  # an option: the session uses shardcheck
    parts = [collected(f"--shardcheck-split={k}/3")[1] for k in (1, 2, 3)]
    assert len(every) == 7 and sorted(sum(parts, [])) == sorted(every) and all(len(p) in (2, 3) for p in parts)
    proc, _ = collected("--shardcheck-split=3/2")
    assert proc.returncode == 4 and "--shardcheck-split" in proc.stderr and "is not K/N" in proc.stderr, proc.stderr



# ---- shardcheck releases: a share of the releases per machine ----------------------------------

def test_releases_split_into_shares_each_release_in_one(monkeypatch, tmp_path, capsys):
    from shardcheck.conformance.cli import releases as command

    todo = command.releases(["torch==2.9.1,2.10.0,2.11.0,2.12.1", "accelerate==1.13.0"])
    shares = [command.share(todo, f"{k}/3") for k in (1, 2, 3)]
    assert sorted(sum(shares, [])) == sorted(todo) and [len(s) for s in shares] == [2, 2, 1]
    tried = []

    def environment(envs, package, version, wanted, installer):
        tried.append(f"{package}=={version}")
        raise command.EnvironmentFailed("not made in this test")

    monkeypatch.setattr(command, "environment", environment)
    code = cli.main(["releases", "torch==2.9.1,2.10.0,2.11.0,2.12.1", "accelerate==1.13.0", "--split", "2/3",
                     "-o", str(tmp_path / "out"), "--envs", str(tmp_path / "envs")])
    assert code == 2 and tried == ["torch==2.10.0", "accelerate==1.13.0"]  # share 2: releases 1 and 4
    assert "share 2/3: torch==2.10.0, accelerate==1.13.0" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        cli.main(["releases", "torch==2.9.1", "--split", "4/3"])
    assert exit_.value.code == codes.USAGE and "argument --split: '4/3' is not K/N" in capsys.readouterr().err
