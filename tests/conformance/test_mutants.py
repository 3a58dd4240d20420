"""Mutation testing of the conformance checks: every mutant of reference_impl must be killed.

For each mutant in ``shardcheck.conformance.mutants.MUTANTS`` (one pytest item each) the check functions it names
run in their OWN pytest process (a mutant patches reference_impl process-wide; started warm, with torch
already imported: tests/warm_python.py)::

    python -m pytest shardcheck/conformance/checks/<dir>/<file>::<check> ... --shardcheck-impl shardcheck.conformance.mutants:<Class> \
        -p shardcheck.conformance.mutants.per_check ...

and at least one cell must FAIL; the killing cell is printed (``-s`` shows it). ``-x`` stops at the
first failed cell, so a killed mutant is cheap. ``test_reference_passes_mutant_subsets`` shows that
the unmutated reference passes every cell that killed a mutant, so a kill is never an artifact of a
check that fails anyway: by this session's own items where it runs those cells, else in a run over
exactly those cells. Every listed check function must kill its mutant
(without -x; ``shardcheck/conformance/mutants/per_check.py`` skips a function's remaining cells once one cell
failed), and ``test_every_check_function_kills_a_mutant`` demands that every check function under
shardcheck/conformance/checks is listed for some mutant (or is UNREACHABLE, with the reason).

The runs are independent processes, so they are started ahead, up to ``SHARDCHECK_MUTANT_JOBS`` at a
time (default 2; 1 under pytest-xdist, which parallelises by itself), and each item waits for its own.
A run uses the threaded backend unless a check it runs judges less there (then gloo:
tests/conformance/mutant_backends.py).
Known survivors (a mutant with ``survivor`` set: a gap in the checks, documented) are strict xfails
that only run with ``SHARDCHECK_MUTANT_SURVIVORS=1``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import warm_python
from mutant_backends import BACKEND, CHECKS, backend_of
from mutant_runs import ROOT, Run, Runs, jobs
from shardcheck.conformance.checks.support import zoo
from shardcheck.conformance.mutants import MUTANTS

RUN_SURVIVORS = os.environ.get("SHARDCHECK_MUTANT_SURVIVORS", "") == "1"
# Only the plugins the checks need: skips ~1 s of plugin imports (hypothesis, xdist, ...) per run.
PLUGINS = ["-p", "shardcheck.pytest_plugin", "-p", "pytest_timeout"]
PER_CHECK = ["-p", "shardcheck.conformance.mutants.per_check"]  # a killed check function's other cells are skipped
BASELINE = "reference"
# The family models judges this transformers-free model with a tied embedding in the mutant runs (and
# only it: the zoo needs the extra shardcheck[models]).
OWN_MODEL = "--shardcheck-model=shardcheck.conformance.mutants.models:tied_tower"


# Check functions no mutant of reference_impl can reach, with the reason (a documented gap).
UNREACHABLE = {
    "test_clip_grad_dtensor.py::test_clip_grad_norm_comm_count_1d":
        "needs dtensor_grads (CommDebugMode counts DTensor collectives); the reference, hence every "
        "mutant, does not declare it, so its cells are unsupported",
    "test_clip_grad_dtensor.py::test_clip_grad_norm_comm_count_2d": "same as comm_count_1d",
    "test_clip_grad_dtensor.py::test_clip_grad_norm_2d":
        "needs tensor_parallel (dp x tp DTensor composition); the reference does not declare it, so its "
        "cells are unsupported for every mutant",
}


def _check_file(name: str) -> Path:
    """A check file by its name, wherever it lives under shardcheck/conformance/checks (api/, behaviour/)."""
    found = sorted(CHECKS.rglob(name))
    assert len(found) == 1, f"check file {name}: {len(found)} matches under {CHECKS}: {found}"
    return found[0]


def _selection(checks) -> list[str]:
    out = []
    for c in checks:
        path, _, func = c.partition("::")
        out.append(f"{_check_file(path).relative_to(ROOT)}::{func}")
    return out


def all_check_functions() -> set[str]:
    """Every `def test_*` at module level under shardcheck/conformance/checks, as "file.py::function"."""
    out = set()
    for f in CHECKS.rglob("test_*.py"):
        out |= {f"{f.name}::{m}" for m in re.findall(r"^def (test_\w+)\(", f.read_text(), re.MULTILINE)}
    return out


def _command(impl: str, selection, stop_at_first_failure: bool, world_sizes=(2,), backend=BACKEND) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", *selection, "--shardcheck-impl", impl, "--shardcheck-backend", backend,
           "--shardcheck-world-sizes", ",".join(map(str, world_sizes)), "-o", "addopts=",
           "-p", "no:cacheprovider", "-rfE", "--shardcheck-rank-timeout", "120", *PLUGINS, OWN_MODEL]
    return cmd + (["-x"] if stop_at_first_failure else [])


def _mutant_command(mutant) -> list[str]:
    # Without -x: EVERY listed check function must show a FAILED cell; per_check skips a function's
    # remaining cells once one failed, so each kill costs about one cell. A mutant naming `cells`
    # runs every cell of its checks (-rA lists the passed ones too): exactly those must fail.
    cmd = _command(f"shardcheck.conformance.mutants:{mutant.__name__}", _selection(mutant.checks), stop_at_first_failure=False,
                   world_sizes=mutant.world_sizes, backend=backend_of(mutant.checks))
    return cmd + ["-rA"] if mutant.cells else cmd + PER_CHECK


def _matches(cell: str, pattern: str) -> bool:
    """`pattern` with `*` as its only wildcard (cell ids hold brackets, fnmatch's character classes)."""
    return re.fullmatch(".*".join(map(re.escape, pattern.split("*"))), cell) is not None


def _cell_outcomes(mutant, run: Run) -> dict[str, str]:
    """{"test_fn[params]" without the implementation: "PASSED" | "FAILED"} from a -rA summary."""
    out = {}
    for word in ("PASSED", "FAILED"):
        for line in run.lines(f"{word} "):
            node = line.removeprefix(f"{word} ").partition(" - ")[0].strip().rpartition("::")[2]
            out[node.replace(f"[shardcheck.conformance.mutants:{mutant.__name__}-", "[")] = word
    return out


def _killing_cells(mutant, run: Run) -> list[str]:
    """The node ids of the cells that killed `mutant`, as the reference's cells."""
    out = []
    for line in run.lines("FAILED"):
        node = line.removeprefix("FAILED ").partition(" - ")[0].strip()
        out.append(node.replace(f"shardcheck.conformance.mutants:{mutant.__name__}", BASELINE))  # wherever the
        # impl's id stands in the brackets (the family models puts the model's first)
    return out


def _baseline_command(cells: list[str], backend: str) -> list[str]:
    """The unmutated reference over exactly the cells that killed some mutant, on their backend."""
    return _command(BASELINE, sorted(set(cells)), stop_at_first_failure=False, world_sizes=(2, 4), backend=backend)


def _is_survivor(mutant) -> bool:
    return mutant.survivor is not None


# ---------------------------------------------------------------------------------------------
# Running ahead: all selected runs start at the first item, at most JOBS at a time.

def _planned(item) -> tuple[str, list[str]] | None:
    """(key, command) of the run an item of this file needs, or None."""
    if getattr(item, "module", None) is None or item.module.__name__ != __name__:
        return None
    if item.originalname == "test_reference_passes_mutant_subsets":
        return None  # planned once the mutant runs are done (it needs their killing cells)
    mutant = item.callspec.params.get("mutant") if hasattr(item, "callspec") else None
    if mutant is None or (_is_survivor(mutant) and not RUN_SURVIVORS) or _lacks_the_zoo(mutant):
        return None
    return mutant.__name__, _mutant_command(mutant)


def _lacks_the_zoo(mutant) -> bool:
    """A mutant whose check loads transformers' models, on a machine without the extra models."""
    return getattr(mutant, "needs_zoo", False) and not zoo.available()


@pytest.fixture(scope="session")
def mutant_runs(request):
    runs = Runs(jobs())
    plans = [p for item in request.session.items if (p := _planned(item))]
    if jobs() > 1:
        for key, cmd in plans:
            runs.get(key, cmd)
    yield runs
    runs.pool.shutdown(wait=False, cancel_futures=True)
    warm_python.kill_live()  # only runs whose items were deselected or interrupted are still going


# ---------------------------------------------------------------------------------------------

def test_catalogue_lists_every_mutant():
    """The docstring catalogue and MUTANTS agree; every mutant names a bug class and existing checks."""
    import shardcheck.conformance.mutants as M

    names = [m.name for m in MUTANTS]
    assert len(set(names)) == len(names), names
    for m in MUTANTS:
        assert m.name.startswith("mutant-") and m.bug and m.__doc__, m
        assert m.name in M.__doc__ and f"({m.__name__})" in M.__doc__, f"{m.name} missing from the catalogue"
        assert m.checks, f"{m.name} names no check"
        for check in m.checks:
            path, _, func = check.partition("::")
            assert func.startswith("test_") and "[" not in func, f"{check}: name whole check functions"
            assert re.search(rf"^def {func}\(", _check_file(path).read_text(), re.MULTILINE), f"{check}: no such check"
    assert len([m for m in MUTANTS if not _is_survivor(m)]) >= 12


def test_every_check_function_kills_a_mutant():
    """Each check function under shardcheck/conformance/checks is listed as killing at least one mutant that
    test_mutant_is_killed runs (a non-survivor), or is in UNREACHABLE with its reason: no check is
    left without a demonstration that it can fail."""
    killers = {c for m in MUTANTS if not _is_survivor(m) for c in m.checks}
    checks = all_check_functions()
    assert not (set(UNREACHABLE) - checks), f"UNREACHABLE names checks that no longer exist: {set(UNREACHABLE) - checks}"
    missing = sorted(checks - killers - set(UNREACHABLE))
    assert not missing, "check functions no mutant is listed for (add one to shardcheck/conformance/mutants):\n  " + "\n  ".join(missing)
    print("\nmutant -> check functions that kill it:")
    for m in MUTANTS:
        print(f"  {m.name}: {', '.join(m.checks)}")


def test_patch_travels_by_pickle():
    """A rank that receives the adapter by pickle (spawn, forkserver) gets the patch from
    __setstate__; a second, different mutant in the same process is refused. Pickled here without
    __init__, so this process stays unmutated."""
    import pickle

    from shardcheck.conformance.mutants import ClipLocalNorm, GradNotAveraged

    blobs = [pickle.dumps(cls.__new__(cls)) for cls in (GradNotAveraged, ClipLocalNorm)]
    code = (
        "import pickle, sys\n"
        "import shardcheck.reference_impl.collectives as C\n"
        "from shardcheck.conformance import mutants\n"
        "original = C.divide_factors\n"
        "a = pickle.loads(sys.stdin.buffer.read(int(sys.argv[1])))\n"
        "assert mutants.applied() == a.name == 'mutant-grad-not-averaged', mutants.applied()\n"
        "assert C.divide_factors is not original\n"
        "pickle.loads(pickle.dumps(a))  # the same mutant again: idempotent\n"
        "try:\n"
        "    pickle.loads(sys.stdin.buffer.read())\n"
        "except RuntimeError as exc:\n"
        "    print('refused:', exc)\n"
        "else:\n"
        "    raise SystemExit('a second mutant was stacked on the first')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(len(blobs[0]))], cwd=ROOT, input=b"".join(blobs),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120, check=False)
    out = proc.stdout.decode()
    assert proc.returncode == 0 and "refused: mutant mutant-clip-local-norm" in out, out
    from shardcheck.conformance.mutants import applied

    assert applied() is None, "this test session itself got mutated"


def _params():
    for m in MUTANTS:
        marks = []
        if _is_survivor(m):
            marks.append(pytest.mark.xfail(strict=True, run=RUN_SURVIVORS,
                                           reason=f"known survivor (gap in the checks): {m.survivor}"))
        if _lacks_the_zoo(m):  # .ci/run kills it where the extra is installed (step 2c)
            marks.append(pytest.mark.skip(reason=zoo.MISSING))
        yield pytest.param(m, id=m.name, marks=marks)


def _zoo_param(m):
    """A mutant whose check needs transformers is skipped without it, saying so (.ci/run's step 2c
    runs it where the extra is installed)."""
    return pytest.param(m, id=m.name, marks=[pytest.mark.skip(reason=zoo.MISSING)] if _lacks_the_zoo(m) else [])


@pytest.mark.parametrize("mutant", list(_params()))
def test_mutant_is_killed(mutant_runs, mutant):
    run = mutant_runs.get(mutant.__name__, _mutant_command(mutant)).result()
    assert f": {mutant.name} " in run.output, f"the run did not load {mutant.name}:\n{run.describe()}"
    failed = run.lines("FAILED")
    errors = [line for line in run.lines("ERROR") if "::" in line]
    assert not errors, f"{mutant.name}: a cell ERRORED (setup/collection), not a clean kill:\n{run.describe()}"
    assert failed, (f"{mutant.name} SURVIVED {', '.join(mutant.checks)} ({run.summary}): "
                    f"no check detects '{mutant.bug}'\n{run.describe()}")
    survived = [c for c in mutant.checks if not any(f"::{c.partition('::')[2]}[" in line and c.partition("::")[0] in line
                                                    for line in failed)]
    assert not survived, (f"{mutant.name} survived listed check(s) {', '.join(survived)} ({run.summary}): each "
                          f"listed check must kill it\n{run.describe()}")
    for line in failed:
        cell, _, why = line.removeprefix("FAILED ").replace(f"shardcheck.conformance.mutants:{mutant.__name__}-", "").partition(" - ")
        print(f"\n{mutant.name} killed by {cell} ({run.summary}; {run.seconds:.1f} s)\n    {why[:240]}")


@pytest.mark.parametrize("mutant", [_zoo_param(m) for m in MUTANTS if m.cells and not _is_survivor(m)])
def test_mutant_kills_exactly_its_cells(mutant_runs, mutant):
    """A mutant naming `cells` fails exactly the cells its globs match, among every cell of its
    checks at its world sizes, and passes all the others: a kill that is sharp, not collateral."""
    run = mutant_runs.get(mutant.__name__, _mutant_command(mutant)).result()
    outcomes = _cell_outcomes(mutant, run)
    assert outcomes, f"no cell outcomes in the run of {mutant.name}:\n{run.describe()}"
    should = {c for c in outcomes if any(_matches(c, g) for g in mutant.cells)}
    failed = {c for c, o in outcomes.items() if o == "FAILED"}
    assert failed == should, (f"{mutant.name}: failed but not named {sorted(failed - should)}; named but passed "
                              f"{sorted(should - failed)}\n{run.describe()}")
    print(f"\n{mutant.name}: exactly {len(failed)} of {len(outcomes)} cells failed ({run.seconds:.1f} s)")


ROW_IN_MESSAGE = re.compile(r"(?:^|; |Error: )([a-z_ ]+?): -?[\d.]+ KiB")  # promises.Row.line


def broken_rows(message: str) -> set[str]:
    """The promise rows a family-sharding failure message names (one "row: N KiB ..." per row)."""
    return set(ROW_IN_MESSAGE.findall(message))


def test_broken_rows_reads_promise_lines():
    message = ("rank 0: AssertionError: gathered during forward: 66.2 KiB at once (0.50x of the parameters); "
               "FULL_SHARD on 2 shards promises <= 54.3 KiB (0.41x); all_gather bytes sent: 1.0 KiB per step (...)")
    assert broken_rows(message) == {"gathered during forward", "all_gather bytes sent"}


@pytest.mark.parametrize("mutant", [_zoo_param(m) for m in MUTANTS if m.rows and not _is_survivor(m)])
def test_mutant_breaks_exactly_its_rows(mutant_runs, mutant):
    """A sharding liar naming `rows` breaks exactly those promise rows in every cell that killed it:
    caught by the row made for it, not by the accident of another."""
    run = mutant_runs.get(mutant.__name__, _mutant_command(mutant)).result()
    failed = run.lines("FAILED")
    assert failed, f"{mutant.name} was not killed:\n{run.describe()}"
    for line in failed:
        rows = broken_rows(line.partition(" - ")[2])
        assert rows == set(mutant.rows), (f"{mutant.name}: broke {sorted(rows)}, expected exactly "
                                          f"{sorted(mutant.rows)}\n{line}")
        print(f"\n{mutant.name}: {line.partition(' - ')[0]} broke exactly {sorted(rows)}")


def _judged_by_this_session(config, items) -> set[tuple[str, str]]:
    """(cell, backend) of every cell of the unmutated reference this session itself runs, the cell
    as a mutant run names it (a session on several backends puts the backend's id after the world
    size; a mutant run, on one, does not). Cell by cell, not by check function: the README's test
    command runs only some of a check's threaded cells (tests/conformance/pairwise_cells.py), and a
    killing cell it does not run is run here. Not explore: its draws depend on the world sizes it is
    given, so a cell of the same id need not be the same cell."""
    out = set()
    for item in items:
        params = item.callspec.params if hasattr(item, "callspec") else {}
        backend = params.get("shardcheck_backend", config.getoption("shardcheck_backend"))  # one backend: no param
        if (getattr(params.get("impl"), "name", None) == BASELINE
                and "world_size" in params and CHECKS in item.path.parents):  # a distributed cell
            cell = re.sub(rf"(-ws\d+)-{re.escape(backend)}(?=[-\]])", r"\1", item.nodeid, count=1)
            out.add((f"{item.path.relative_to(ROOT)}::{cell.partition('::')[2]}", backend))
    return out


def test_a_cell_of_this_session_is_judged_under_the_id_a_mutant_run_gives_it():
    """A session on two backends names its cells with the backend after the world size, a mutant
    run on one backend without it; only the cells the session holds are judged by it."""
    from types import SimpleNamespace

    path = CHECKS / "behaviour" / "test_composition.py"
    item = SimpleNamespace(path=path, nodeid=f"{path.relative_to(ROOT)}::test_buffers[reference-ws2-threaded-FULL_SHARD]",
                           callspec=SimpleNamespace(params={"impl": SimpleNamespace(name=BASELINE), "world_size": 2,
                                                            "shardcheck_backend": "threaded"}))
    config = SimpleNamespace(getoption=lambda name: "gloo,threaded")
    cell = f"{path.relative_to(ROOT)}::test_buffers[reference-ws2-FULL_SHARD]"
    assert _judged_by_this_session(config, [item]) == {(cell, "threaded")}
    assert (cell.replace("FULL", "NO"), "threaded") not in _judged_by_this_session(config, [item])


def test_reference_passes_mutant_subsets(mutant_runs, request):
    """The unmutated reference passes every cell that killed a mutant, so a kill is never an
    artifact of a check that fails anyway. The cells this session itself runs on the reference (the
    README's test command runs most) are judged by its own items; the others run, exactly those
    cells, in a process of its own. (Last in this file: it needs the mutant runs' results.)"""
    judged = _judged_by_this_session(request.config, request.session.items)
    live = [m for m in MUTANTS if (RUN_SURVIVORS or not _is_survivor(m)) and not _lacks_the_zoo(m)]
    cells: dict[str, list[str]] = {}  # backend -> killing cells this session does not run
    killing = 0
    for m in live:
        backend = backend_of(m.checks)
        killed_by = _killing_cells(m, mutant_runs.get(m.__name__, _mutant_command(m)).result())
        assert killed_by, f"{m.name}: no killing cell to check the reference on"
        killing += len(killed_by)
        cells.setdefault(backend, []).extend(c for c in killed_by if (c, backend) not in judged)
    here = sum(map(len, cells.values()))
    print(f"\nthe reference over the {killing} cells that killed mutants: {killing - here} judged by this "
          f"session's own items, {here} run here")
    for backend, chosen in cells.items():
        if not chosen:
            continue
        run = mutant_runs.get(f"{BASELINE}-{backend}", _baseline_command(chosen, backend)).result()
        print(f"reference over {len(set(chosen))} killing cells on {backend}: {run.summary} ({run.seconds:.1f} s)")
        bad = run.lines("FAILED") + run.lines("ERROR")
        assert run.returncode == 0 and not bad, "the reference fails cells that killed mutants:\n" + run.describe()
        assert re.search(r"\d+ passed", run.summary), run.describe()
