"""pytest plugin (entry point `pytest11: shardcheck-conformance`): which implementations are checked.

- `--impl NAME` (repeatable, or comma-separated; also $SHARDCHECK_IMPL): every test taking the `impl`
  fixture runs once per implementation (`[reference]`, `[torch-fsdp2]`, ...).
- `@pytest.mark.requires("cpu_offload", ...)` names the capabilities a cell needs;
  `@pytest.mark.requires.with_args(lambda params: {...})` derives them from the cell's parameters
  (`with_args`: a lone callable would be taken for the decorated function). A cell whose adapter
  lacks one is *unsupported*: reported with its own status (U), never a pass, never a failure.
- Each adapter's expectations manifest (patterns are globs where only `*` and `?` are special) (conformance/expectations/<name>.toml) turns known failures
  into strict xfails: a cell that now passes fails, and so does an entry that matches no cell.
"""

from __future__ import annotations

import fnmatch
import os
from pathlib import Path

import pytest
import tomllib
import torch
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from conformance import adapters
from conformance.adapter import UNSUPPORTED_PREFIX
from conformance.cells import strip_impl

EXPECTATIONS = Path(__file__).parent / "expectations"


def pytest_addoption(parser):
    group = parser.getgroup("shardcheck-conformance", "shardcheck conformance: implementations")
    group.addoption("--impl", action="append", default=None,
                    help="implementation(s) to check: a built-in name (reference, torch-fsdp2, "
                         "torch-fsdp1, ddp), an entry point of group 'shardcheck.adapters', or "
                         "pkg.module:attr. Repeatable. Default: $SHARDCHECK_IMPL or reference.")


def pytest_configure(config):
    config.addinivalue_line("markers", "requires(*capabilities): capabilities the cell needs")
    names = config.getoption("impl") or [os.environ.get("SHARDCHECK_IMPL", "reference")]
    names = [n.strip() for chunk in names for n in chunk.split(",") if n.strip()]
    try:
        config._shardcheck_impls = {n: adapters.load(n) for n in dict.fromkeys(names)}
    except adapters.UnknownAdapter as exc:
        raise pytest.UsageError(str(exc)) from None
    config._shardcheck_manifests = {n: load_manifest(a) for n, a in config._shardcheck_impls.items()}


def pytest_report_header(config):
    lines = []
    for name, adapter in config._shardcheck_impls.items():
        lines.append(f"shardcheck impl {name}: {adapter.name} {adapter.version} "
                     f"[{', '.join(sorted(adapter.capabilities))}]")
    return lines


def pytest_generate_tests(metafunc):
    if "impl" in metafunc.fixturenames:
        impls = metafunc.config._shardcheck_impls
        metafunc.parametrize("impl", list(impls.values()), ids=list(impls))


def required_capabilities(item) -> set[str]:
    needed: set[str] = set()
    params = getattr(item, "callspec", None) and item.callspec.params or {}
    for marker in item.iter_markers("requires"):
        for arg in marker.args:
            needed |= set(arg(params)) if callable(arg) else {arg}
    return needed


def pytest_runtest_setup(item):
    adapter = getattr(item, "callspec", None) and item.callspec.params.get("impl")
    if adapter is None:
        return
    missing = sorted(required_capabilities(item) - set(adapter.capabilities))
    if missing:
        pytest.skip(f"{UNSUPPORTED_PREFIX} {adapter.name} does not declare {', '.join(missing)}")


def pytest_report_teststatus(report, config):
    if report.skipped and UNSUPPORTED_PREFIX in str(getattr(report, "longrepr", "")):
        return "unsupported", "U", "UNSUPPORTED"
    return None


# ---- expectations manifests -------------------------------------------------------------------

def load_manifest(adapter) -> list[dict]:
    """The adapter's `expectations` file if it names one (third-party adapters ship their own),
    else conformance/expectations/<name>.toml."""
    path = Path(getattr(adapter, "expectations", None) or EXPECTATIONS / f"{adapter.name}.toml")
    if not path.exists():
        return []
    entries = tomllib.loads(path.read_text()).get("xfail", [])
    for entry in entries:
        missing = {"cells", "reason", "repro"} - set(entry)
        if missing:
            raise pytest.UsageError(f"{path}: an entry lacks {', '.join(sorted(missing))}: {entry}")
        entry["_path"] = str(path)
    return [e for e in entries if Version(torch.__version__.split("+")[0]) in SpecifierSet(e.get("torch", ""))]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items):
    """Mark known failures as strict xfails, before -k/-m deselect anything."""
    collected_files = {Path(i.nodeid.split("::")[0]).name for i in items}
    for impl_name, entries in config._shardcheck_manifests.items():
        used = set()
        for item in items:
            adapter = getattr(item, "callspec", None) and item.callspec.params.get("impl")
            if adapter is None or adapter is not config._shardcheck_impls[impl_name]:
                continue
            cell = strip_impl(item.nodeid, impl_name)
            for i, entry in enumerate(entries):
                if any(fnmatch.fnmatchcase(cell, pattern.replace("[", "[[]")) for pattern in entry["cells"]):
                    used.add(i)
                    item.add_marker(pytest.mark.xfail(strict=True, reason=f"known: {entry['reason']}"))
                    item.user_properties.append(("expectation", {"reason": entry["reason"],
                                                                 "repro": entry["repro"]}))
                    break
        for i, entry in enumerate(entries):
            files = {p.split("::")[0] for p in entry["cells"]}
            if i not in used and files & collected_files:
                raise pytest.UsageError(f"{entry['_path']}: entry matches no cell: {entry['cells']} "
                                        f"({entry['reason']}); remove or fix it")
