"""The conformance plugin's promises: implementation selection, unsupported is never a pass,
expectations manifests are strict (a known failure must show its entry's error), and the JSON
report records every cell."""

import textwrap

import pytest
import warm_python

from shardcheck.conformance.report import reading

ADAPTER = '''
import torch
from shardcheck.conformance.adapters.reference import ReferenceAdapter

class Fake(ReferenceAdapter):
    name = "fake"
    capabilities = frozenset({"full_shard"})
    expectations = __import__("pathlib").Path(__file__).with_name("fake.toml")
'''
CHECKS = '''
import pytest

from shardcheck.harness import distributed

@distributed(world_size=2)
@pytest.mark.requires("full_shard")
@pytest.mark.parametrize("x", [1, 2])
def test_supported(ctx, impl, x):
    ctx.record("error", {"what": "x", "max_abs": 0.1 * x, "max_rel": 0.0, "rtol": 1e-6, "atol": 1e-5})
    assert x == 1 or impl.name != "fake", "cell 2 is known to fail"

@distributed(world_size=2)
@pytest.mark.requires("cpu_offload")
def test_needs_offload(ctx, impl):
    pass

@distributed(world_size=2)
def test_raises_unsupported_on_ranks(ctx, impl):
    from shardcheck.conformance.protocol import Unsupported
    raise Unsupported("the adapter has no such method")
'''


def _session(tmp_path, manifest, *args, target="test_checks.py"):
    (tmp_path / "fake_adapter.py").write_text(ADAPTER)
    (tmp_path / "test_checks.py").write_text(CHECKS)
    (tmp_path / "fake.toml").write_text(textwrap.dedent(manifest))
    proc = warm_python.run(["-m", "pytest", "-p", "no:cacheprovider", "-rA",
                            "--shardcheck-impl", "fake_adapter:Fake", target, *args], cwd=tmp_path, timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


KNOWN = '''
[[xfail]]
cells = ["test_checks.py::test_supported[ws2-2]"]
reason = "cell 2 is known to fail"
repro = "assert 2 == 1"
error = 'cell \\d is known to fail'
kind = "bug"
'''


def test_unsupported_is_its_own_status_and_known_failures_are_xfails(tmp_path):
    code, out = _session(tmp_path, KNOWN, "--shardcheck-report", "r.json")
    assert code == 0, out
    assert "1 passed, 1 xfailed, 2 unsupported" in out
    report = reading.load(tmp_path / "r.json")
    outcomes = {c["check"] + str(c["params"].get("x", "")): c["outcome"] for c in report["cells"]}
    assert outcomes == {"test_supported1": "passed", "test_supported2": "xfailed",
                        "test_needs_offload": "unsupported", "test_raises_unsupported_on_ranks": "unsupported"}
    assert report["complete"] and report["schema_version"] == 7
    assert report["implementations"][0]["name"] == "fake"
    cell = next(c for c in report["cells"] if c["params"].get("x") == 1)
    assert cell["max_abs_err"] == 0.1 and cell["tolerances"] == [[1e-6, 1e-5]]
    assert (tmp_path / "r.jsonl").exists()


def test_a_check_module_named_by_pyargs_outside_the_rootdir_keeps_its_file(tmp_path):
    """`pytest --pyargs <a check module>` from a folder of the user's own: pytest's node ids then
    leave the file out ("::test_x[...]"); the manifest's entries still mark their cells and the
    report names each cell's file."""
    (tmp_path / "elsewhere").mkdir()
    code, out = _session(tmp_path, KNOWN, "--rootdir", "elsewhere", "--pyargs", "--shardcheck-report", "r.json",
                         target="test_checks")
    assert code == 0 and "1 passed, 1 xfailed, 2 unsupported" in out, out
    assert {c["nodeid"].split("::")[0] for c in reading.load(tmp_path / "r.json")["cells"]} == {"test_checks.py"}


def test_an_entry_matching_no_cell_is_an_error(tmp_path):
    code, out = _session(tmp_path, KNOWN.replace("[ws2-2]", "[ws2-9]"))
    assert code == 4 and "entry matches no cell" in out


def test_a_known_failure_that_passes_fails_the_run(tmp_path):
    code, out = _session(tmp_path, KNOWN.replace("[ws2-2]", "[ws2-1]"))
    assert code == 1 and "XPASS(strict)" in out


def test_a_known_failure_with_another_error_fails_the_run_naming_the_entry(tmp_path):
    """The entry's regex is not in the cell's failure: the cell is failed, not xfailed, and its
    text starts with the entry (manifest, finding, regex) and the actual failure, kept whole below."""
    manifest = KNOWN.replace("cell \\d is known to fail", "infinity norm on an empty tensor") + 'finding = "F9"\n'
    code, out = _session(tmp_path, manifest, "--shardcheck-report", "r.json")
    assert code == 1, out
    assert "1 failed, 1 passed, 2 unsupported" in out
    cell = next(c for c in reading.load(tmp_path / "r.json")["cells"] if c["params"].get("x") == 2)
    head, _, rest = cell["message"].partition("\n")
    assert cell["outcome"] == "failed" and head.startswith(
        "expectation fake.toml (F9) expects an error matching 'infinity norm on an empty tensor'; "
        "the cell failed with: rank ")
    assert "AssertionError: cell 2 is known to fail" in head
    assert "AssertionError: cell 2 is known to fail" in rest  # the original failure, kept


PLATFORM = KNOWN.replace('kind = "bug"', 'kind = "platform"\nbackends = ["threaded"]')


def test_a_platform_limitation_is_judged_only_on_its_backends(tmp_path):
    """An entry of kind platform names its backends: there the cell is a known failure; on another
    backend (gloo here, as a GPU's nccl would be) the same cell is judged as any, so its failure fails."""
    code, out = _session(tmp_path, PLATFORM, "--shardcheck-backend", "threaded")
    assert code == 0 and "1 passed, 1 xfailed, 2 unsupported" in out, out
    code, out = _session(tmp_path, PLATFORM, "--shardcheck-backend", "gloo")
    assert code == 1 and "1 failed, 1 passed, 2 unsupported" in out, out


@pytest.mark.parametrize("backends, problem", [(None, 'kind "platform" needs backends'),
                                               ('["cpu"]', "backends must be a non-empty list")])
def test_a_platform_entry_names_real_backends(tmp_path, backends, problem):
    manifest = KNOWN.replace('kind = "bug"', 'kind = "platform"' + (f"\nbackends = {backends}" if backends else ""))
    code, out = _session(tmp_path, manifest)
    assert code == 4 and "fake.toml xfail entry 1" in out and problem in out, out


@pytest.mark.parametrize("error, problem", [(None, "lacks error"), ("step (", "is not a regex")])
def test_an_xfail_entry_without_a_valid_error_is_an_error(tmp_path, error, problem):
    lines = [line for line in KNOWN.splitlines() if not line.startswith("error")]
    manifest = "\n".join(lines + ([f"error = {error!r}"] if error else [])) + "\n"
    code, out = _session(tmp_path, manifest)
    assert code == 4 and "fake.toml xfail entry 1" in out and problem in out, out


def test_unknown_implementation_is_one_line(tmp_path):
    proc = warm_python.run(["-m", "pytest", "--shardcheck-impl", "nope", "--co"], cwd=tmp_path, timeout=120)
    assert proc.returncode == 4
    assert ("unknown implementation 'nope'; available: accelerate, ddp, deepspeed, lightning, megatron-fsdp, "
            "reference, torch-fsdp1, torch-fsdp2, torch-zero, torchtitan-simplefsdp") in proc.stderr
    assert "Traceback" not in proc.stderr


def test_impl_all_is_every_builtin_and_variant_and_says_what_it_left_out(monkeypatch):
    from shardcheck.conformance import adapters

    names, left_out = adapters.every_builtin()
    assert {"reference", "torch-fsdp2", "torch-fsdp1", "torch-fsdp1[flat]", "ddp"} <= set(names)
    for optional in ("deepspeed", "torchtitan-simplefsdp", "megatron-fsdp"):
        assert (optional in names) != (optional in left_out)  # installed, or said why not
    monkeypatch.setitem(adapters.BUILTIN, "missing", "no_such_engine_module:Adapter")
    names, left_out = adapters.every_builtin()
    assert "missing" not in names and "no_such_engine_module" in left_out["missing"]
