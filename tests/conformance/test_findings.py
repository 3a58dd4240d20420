"""Findings are reproducible from the repository: every expectations-manifest entry names a repro
script that exists and a finding that FINDINGS.md documents; FINDINGS.md cites scripts, never a
throw-away path; and every script still reproduces its failure on the installed torch (one item
per script, a few seconds each)."""

from __future__ import annotations

import functools
import re
import tomllib
import warnings
from pathlib import Path

import importlib.util

import pytest

import warm_python

ROOT = Path(__file__).resolve().parents[2]
EXPECTATIONS = ROOT / "shardcheck" / "conformance" / "expectations"
REPROS = EXPECTATIONS / "repros"
FINDINGS = (EXPECTATIONS / "FINDINGS.md").read_text()
SCRIPTS = sorted(p for p in REPROS.glob("*.py") if not p.name.startswith("_"))
# An optional implementation's scripts need it installed; the .ci/run step that installs it runs them here (-k).
OPTIONAL = {"deepspeed_": "deepspeed", "torchtitan_": "torchtitan", "torchao_": "torchao", "megatron_fsdp_": "megatron_fsdp",
            "accelerate_": "accelerate", "lightning_": "lightning"}


# A finding on CUDA only: its script needs one CUDA device (`_one_cuda_rank.py`); elsewhere it says so.
CUDA_ONLY = "_cuda_"


@functools.cache  # asked once per CUDA-only script at collection, and by its test
def _has_cuda() -> bool:
    from shardcheck.harness import cuda  # NVML: asking torch would load the driver in this process

    return cuda.device_count() > 0


def _runnable(script: Path) -> bool:
    if CUDA_ONLY in script.name and not _has_cuda():
        return False
    return not any(script.name.startswith(prefix) and importlib.util.find_spec(module) is None
                   for prefix, module in OPTIONAL.items())


def _entries():
    for manifest in sorted(EXPECTATIONS.glob("*.toml")):
        tables = tomllib.loads(manifest.read_text())  # cells' known failures, and explore's
        for i, entry in enumerate(tables.get("xfail", []) + tables.get("explore", [])):
            yield pytest.param(entry, id=f"{manifest.stem}-{i}")


def _sections() -> dict[str, str]:
    """{"F2": the text of '## F2 - ...' up to the next heading}."""
    parts = re.split(r"^## (F\d+)\b", FINDINGS, flags=re.MULTILINE)
    return {parts[i]: parts[i + 1].split("\n## ")[0] for i in range(1, len(parts), 2)}


@pytest.mark.parametrize("entry", list(_entries()))
def test_every_manifest_entry_has_a_repro_script_and_a_documented_finding(entry):
    repro = ROOT / entry["repro"]
    assert repro.is_file() and repro.parent == REPROS, f"repro {entry['repro']!r} is not a script in {REPROS}"
    assert "finding" in entry, "an entry names its finding (the matrix groups known failures by it)"
    assert entry["finding"] in _sections(), f"{entry['finding']} is not a '## {entry['finding']}' of FINDINGS.md"
    assert entry["repro"] in _sections()[entry["finding"]], "FINDINGS.md cites the entry's script"


def test_findings_cite_existing_scripts_and_no_throwaway_path():
    assert "/tmp" not in FINDINGS
    cited = set(re.findall(r"shardcheck/conformance/expectations/repros/[\w.]+\.py", FINDINGS))
    assert cited == {str(p.relative_to(ROOT)) for p in SCRIPTS}  # every script cited, none missing
    without = [f for f, text in _sections().items() if "repros/" not in text]
    assert without == [], without  # every finding cites its reproduction


# glibc's own abort lines: a rank killed on a corrupted heap. Gloo collectives in flight together can
# corrupt it (F67: two functional all-gathers, about once in 10,000 pairs); a CI rehearsal saw
# megatron_fsdp_prefetches_every_unit's rank 0 abort so once in many runs (Megatron-FSDP keeps several
# all-gathers in flight; the cause there is not isolated).
HEAP_ABORTS = ("malloc(): ", "free(): ", "double free or corruption", "corrupted size vs. prev_size")


def _heap_abort(output: str) -> str | None:
    """The first line of `output` that is glibc aborting a process on a corrupted heap, or None."""
    return next((line.strip() for line in output.splitlines() if line.strip().startswith(HEAP_ABORTS)), None)


def test_only_a_heap_abort_earns_a_repro_its_second_run():
    assert _heap_abort("rank 0: hung\nmalloc(): unaligned tcache chunk detected\n") == \
        "malloc(): unaligned tcache chunk detected"
    assert _heap_abort("NOT REPRODUCED: more than half the model gathered at once\nrank 1: raised RuntimeError") is None
    assert _heap_abort("raised RuntimeError: the script printed malloc(): in a message") is None


@pytest.mark.timeout(270)
@pytest.mark.parametrize("script", [pytest.param(s, id=s.stem) for s in SCRIPTS if _runnable(s)])
def test_every_repro_reproduces(script):
    """One item per script, so that pytest-xdist spreads them (several wait on deadlines). The scripts
    of optional implementations that are not installed are left to test_optional_repros. A run in
    which a rank died on glibc's heap check (see HEAP_ABORTS) decides nothing: the script runs once more,
    which decides, and the first run's abort is a warning in the summary (a script that aborts
    so twice fails)."""
    proc, reproduced = _run_repro(script)
    if not reproduced and (abort := _heap_abort(proc.stdout + proc.stderr)):
        warnings.warn(f"{script.stem}: a rank aborted on a corrupted heap ({abort}); the second run decides")
        proc, reproduced = _run_repro(script)
    assert reproduced, proc.stdout[-1500:] + proc.stderr[-1500:]


def _run_repro(script: Path):
    """`python script`, started with torch imported, and whether it exited 0 ending with `REPRODUCED: ...`."""
    proc = warm_python.run([str(script)], cwd=ROOT, timeout=120)
    last = proc.stdout.strip().splitlines()[-1:] or [""]
    return proc, proc.returncode == 0 and last[0].startswith("REPRODUCED: ")


@pytest.mark.parametrize("script", [pytest.param(s, id=s.stem) for s in SCRIPTS if CUDA_ONLY in s.name])
def test_cuda_only_repros_say_in_one_line_that_they_need_a_device(script):
    """On a machine without CUDA (CI) a CUDA-only script runs up to its device check and says why it
    did not reproduce: exit 2 and one NOT RUN line, never a REPRODUCED it did not see."""
    if _has_cuda():
        pytest.skip("this machine has a CUDA device: test_every_repro_reproduces runs the script")
    proc = warm_python.run([str(script)], cwd=ROOT, timeout=120)
    assert proc.returncode == 2 and proc.stdout.strip().splitlines() == [
        "NOT RUN: this finding is on CUDA only; the script needs one CUDA device"], proc.stdout + proc.stderr[-1500:]


@pytest.mark.parametrize("prefix,module", sorted(OPTIONAL.items()))
def test_optional_repros_are_present_and_run_where_installed(prefix, module):
    scripts = [s for s in SCRIPTS if s.name.startswith(prefix)]
    assert scripts, f"no {prefix}* repro scripts"
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed: its repros run in .ci/run, where it is")


def test_a_torch_outside_the_judged_releases_is_said_in_one_line():
    """shardcheck never replaces the user's torch (a lower bound only): on a release it was not judged
    on it runs, and says that known failures scoped to the judged releases do not apply."""
    from importlib.metadata import requires

    from shardcheck.conformance.expectations import judged_releases

    torch_requirement = [r for r in requires("shardcheck") if r.split(">")[0].split("=")[0] == "torch"]
    assert torch_requirement == ["torch>=2.9"], torch_requirement  # no upper cap
    assert judged_releases.unjudged("2.13.0+cpu", ["deepspeed"]) is None and judged_releases.unjudged(None) is None
    note = judged_releases.unjudged("2.15.0+cu130", ["reference"])
    assert note.startswith("torch 2.15.0+cu130 is not a release shardcheck's expectations were judged on "
                           "(2.9.1, 2.10.0, 2.11.0, 2.12.1, 2.13.0, 2.14.1)")
    assert judged_releases.unjudged("2.12.0", ["reference"]).startswith("torch 2.12.0 is not a release")
    assert judged_releases.unjudged("2.9.1+cu128", ["torch-fsdp2", "torch-fsdp1[flat]", "ddp", "reference"]) is None
    assert "\n" not in note
    assert judged_releases.unjudged("2.14.1+cu130", ["torch-fsdp2", "torch-fsdp1[flat]", "ddp"]) is None
    note = judged_releases.unjudged("2.14.1", ["torch-fsdp2", "deepspeed"])
    assert note.startswith("torch 2.14.1: the expectations of deepspeed were judged on 2.13.0 only")
