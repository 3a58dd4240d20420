"""pytest plugin (registered by shardcheck.pytest_plugin, the entry point): which implementations are checked.

- `--impl NAME` (repeatable, or comma-separated; also $SHARDCHECK_IMPL): every test taking the `impl`
  fixture runs once per implementation (`[reference]`, `[torch-fsdp1[flat]]`, ...).
- `@pytest.mark.requires("cpu_offload", ...)` names the capabilities a cell needs;
  `@pytest.mark.requires.with_args(lambda params: {...})` derives them from the cell's parameters
  (`with_args`: a lone callable would be taken for the decorated function). Every name must be in
  the vocabulary (shardcheck/conformance/protocol/capabilities.py). A cell whose adapter lacks one is
  *unsupported*: its own outcome (U), never a pass, never a failure. So is a cell whose adapter or
  check raises `Unsupported`, on any rank.
- Each implementation's expectations manifest turns known failures into strict xfails: a cell that
  now passes fails, and so does an entry that matches no collected cell. A cell that fails with an
  error other than its entry's (`error`, a regex) fails too (expected_errors.py, registered here).
- `--shardcheck-split K/N`: part K of N of the selected cells (split.py, registered here when asked for).
"""

from __future__ import annotations

import fnmatch
import os
import sys
from pathlib import Path

import pytest

from shardcheck.conformance.protocol import outcomes
from shardcheck.conformance.plugins import expected_errors
from shardcheck.conformance.report.cells import nodeid_of, strip_impl
from shardcheck.conformance.report.writer import WRITER
from shardcheck.harness.plugin import backend_of
from shardcheck.session_state import Selection, of

# Nothing above imports torch or an adapter: they are loaded when a test takes `impl` (a
# conformance check) or --shardcheck-impl is given, not in every session of the environment.
# Modules the ranks import on first use, to import once in the parent before ranks fork
# (shardcheck.harness.preload): the first construction of a torch optimizer (Optimizer.build) imports
# torch._dynamo, a costly import in every rank of every pool (docs/speed.md).
RANK_PRELOAD = ("torch._dynamo",)


def pytest_configure(config):
    for module in RANK_PRELOAD:  # imported once in the parent, not in every rank of every pool
        try:
            config.addinivalue_line("rank_preload", module)
        except ValueError:
            break  # the harness plugin is off (-p no:shardcheck): no ranks, nothing to preload
    if not config.pluginmanager.has_plugin("shardcheck-expected-errors"):
        config.pluginmanager.register(expected_errors, "shardcheck-expected-errors")
    if config.getoption("shardcheck_split", None) and not config.pluginmanager.has_plugin("shardcheck-split"):
        from shardcheck.conformance.plugins import split  # part K of N of the selected cells

        config.pluginmanager.register(split, "shardcheck-split")
    if config.getoption("shardcheck_impl"):
        impls(config)  # asked for: load now, so that a bad name is a usage error before collection


def impls(config) -> dict:
    """{name: adapter} of the implementations checked, loaded on first use with their manifests
    (the session's state holds them: shardcheck/session_state.py)."""
    state = of(config)
    if state.selection is not None:
        return state.selection.impls
    from shardcheck.conformance import adapters
    from shardcheck.conformance.expectations import manifest

    names = config.getoption("shardcheck_impl") or [os.environ.get("SHARDCHECK_IMPL", "reference")]
    names = [n.strip() for chunk in names for n in _split(chunk) if n.strip()]
    if not names:
        raise pytest.UsageError("--shardcheck-impl: no implementation named")
    if "all" in names:
        every, left_out = adapters.every_builtin()
        names = [m for n in names for m in (every if n == "all" else [n])]
        if not hasattr(config, "workerinput"):  # said once, by the controller
            for name, reason in left_out.items():
                print(f"shardcheck: --impl all: {name} left out: {reason}", file=sys.stderr)
    try:
        loaded = {n: adapters.load(n) for n in dict.fromkeys(names)}
        state.selection = Selection(impls=loaded, manifests={n: manifest.load(a) for n, a in loaded.items()},
                                    reasons={a.name: manifest.unsupported(a) for a in loaded.values()})
    except (adapters.UnknownAdapter, manifest.ManifestError) as exc:
        raise pytest.UsageError(str(exc)) from None
    return loaded


def _split(chunk: str) -> list[str]:
    """Comma-separated names; a comma inside [variant] brackets does not split."""
    out, depth, cur = [], 0, ""
    for ch in chunk:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    return out + [cur]


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    """The report writer's header (written at its sessionstart, after this) names the implementations
    checked: loaded now into the session's state, where it reads them."""
    if session.config.pluginmanager.has_plugin(WRITER):
        impls(session.config)


def pytest_report_header(config):
    selection = of(config).selection
    if selection is None:
        return None  # not asked for (--shardcheck-impl): no line in an unrelated session's header
    from shardcheck.conformance.expectations import judged_releases

    note = judged_releases.unjudged(judged_releases.installed_torch(), list(selection.impls))
    return [f"shardcheck impl {name}: {a.name} {a.version} [{', '.join(sorted(a.capabilities))}]"
            for name, a in selection.impls.items()] + ([f"shardcheck: {note}"] if note else [])


def pytest_generate_tests(metafunc):
    if "impl" in metafunc.fixturenames:
        checked = impls(metafunc.config)
        metafunc.parametrize("impl", list(checked.values()), ids=list(checked))


def required_capabilities(item) -> set[str]:
    needed: set[str] = set()
    params = getattr(item, "callspec", None) and item.callspec.params or {}
    for marker in item.iter_markers("requires"):
        for arg in marker.args:
            needed |= set(arg(params)) if callable(arg) else {arg}
    return needed


def _adapter_of(item):
    return getattr(item, "callspec", None) and item.callspec.params.get("impl")


def pytest_runtest_setup(item):
    adapter = _adapter_of(item)
    if adapter is None:
        return
    missing = sorted(required_capabilities(item) - set(adapter.capabilities))
    if missing:
        from shardcheck.conformance.expectations.manifest import NO_REASON

        selection = of(item.config).selection
        known = selection.reasons if selection else {}
        reasons = {c: known.get(adapter.name, {}).get(c) or NO_REASON for c in missing}
        item.user_properties.append((outcomes.MISSING_PROPERTY, reasons))  # the run's summary groups by it
        raise outcomes.Unsupported(f"{adapter.name} does not declare "
                                   + "; ".join(f"{c} ({why})" for c, why in reasons.items()))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Unsupported is an outcome of its own: carried as a user property (it survives xdist)."""
    rep = (yield).get_result()
    if rep.skipped and outcomes.is_unsupported_message(str(rep.longrepr)) and not hasattr(rep, "wasxfail"):
        rep.user_properties.append((outcomes.PROPERTY, "unsupported"))


def pytest_report_teststatus(report, config):
    if outcomes.outcome_of(report) == "unsupported":
        return "unsupported", "U", "UNSUPPORTED"
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items):
    """Check every requires() name; mark known failures as strict xfails before -k/-m deselect."""
    selection = of(config).selection
    if selection is None:
        return  # no test took `impl`: no conformance cell here
    from shardcheck.conformance.expectations import manifest
    from shardcheck.conformance.protocol import capabilities

    for item in items:
        if _adapter_of(item) is None:
            continue
        bad = capabilities.unknown(required_capabilities(item))
        if bad:
            raise pytest.UsageError(f"{item.nodeid}: requires unknown capability {', '.join(bad)}")
    # files collected whole: an entry of one must match some cell (a file named with ::, a few of
    # its cells, need not hold the entry's)
    partly = {Path(arg.split("::")[0]).name for arg in config.args if "::" in arg}
    collected_files = {Path(nodeid_of(i).split("::")[0]).name for i in items} - partly
    for impl_name, entries in selection.manifests.items():
        used = set()
        for item in items:
            if _adapter_of(item) is not selection.impls[impl_name]:
                continue
            cell = strip_impl(nodeid_of(item), impl_name)
            for i, entry in enumerate(entries):
                if any(fnmatch.fnmatchcase(cell, pattern.replace("[", "[[]")) for pattern in entry["cells"]):
                    used.add(i)
                    if "backends" in entry and not manifest.on_backend(entry, backend_of(item)):
                        continue  # another platform's limitation: judged as any cell here
                    item.add_marker(pytest.mark.xfail(strict=True, reason=f"known: {entry['reason']}"))
                    expected_errors.expect(item, entry)
                    item.user_properties.append(("expectation", {k: entry[k] for k in
                                                                 ("reason", "repro", "finding") if k in entry}))
                    break
        for i, entry in enumerate(entries):
            files = {p.split("::")[0] for p in entry["cells"]}
            if i not in used and files & collected_files:
                raise pytest.UsageError(f"{entry['_path']}: entry matches no cell: {entry['cells']} "
                                        f"({entry['reason']}); remove or fix it")
