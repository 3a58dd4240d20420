"""shardcheck's one pytest entry point (`pytest11: shardcheck`; `-p no:shardcheck` turns all of it off).

Every `--shardcheck-*` option is declared here, and nothing else is imported until a session uses
shardcheck (but the built-in adapters' names, data alone, that `--shardcheck-impl`'s help lists): a
session that does not pays for this module alone. A session uses it when

- one of its options is on the command line (or in PYTEST_ADDOPTS), or a launcher (torchrun, or
  srun with SHARDCHECK_LAUNCHER=srun) started this process;
- it collects from the shardcheck package (`--pyargs shardcheck.conformance.checks`, `shardcheck run`);
- a collected test is marked `@distributed` (`from shardcheck.harness import distributed`): the
  plugins are registered before it is made into items.

Then three plugins are registered, one concern each: the harness (`shardcheck.harness.plugin`:
`@distributed` tests on N ranks), which implementations are checked
(`shardcheck.conformance.plugins.selection`) and the JSON report
(`shardcheck.conformance.report.writer`). What they share lives in one `SessionState` in the
config's stash (shardcheck/session_state.py), never in attributes of the config.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from shardcheck.builtin_adapters import BUILTIN  # data alone: the names --shardcheck-impl's help lists

OPTION_PREFIX = "--shardcheck-"  # every option of shardcheck: no clash with a project's own
# A test body's deadline when nothing else gives one: a hang costs this much. Several times the
# slowest cell of the reference and of any engine (explore, several configurations in one cell;
# the figures: docs/speed.md).
RANK_TIMEOUT_S = 60.0
PLUGINS = {"shardcheck-harness": "shardcheck.harness.plugin",
           "shardcheck-conformance": "shardcheck.conformance.plugins.selection",
           "shardcheck-report": "shardcheck.conformance.report.writer"}
HERE = Path(__file__).parent

_parser = []  # kept for `-n gpus` when pytest-xdist registers after this plugin


def _rewrite_the_checks_only() -> None:
    """pytest rewrites the asserts of every module of a plugin's distribution: all of shardcheck,
    some 270 modules, seconds of CPU in each session where bytecode is not cached (the README's test
    command starts dozens). Only the checks' asserts need it (their files are test modules, and
    their helpers live beside them); the harness, the reference and the tools raise their own
    messages. Narrowed here, on import, before any of them is imported."""
    for finder in sys.meta_path:
        marked = getattr(finder, "_must_rewrite", None)  # pytest's AssertionRewritingHook
        if isinstance(marked, set) and "shardcheck" in marked:
            marked.discard("shardcheck")
            marked.add("shardcheck.conformance.checks")


_rewrite_the_checks_only()


def pytest_addoption(parser, pluginmanager):
    _parser[:] = [parser]
    _teach_gpus(pluginmanager)
    group = parser.getgroup("shardcheck", "shardcheck harness: running test bodies on N ranks")
    group.addoption("--shardcheck-backend", dest="shardcheck_backend",
                    default=os.environ.get("SHARDCHECK_BACKEND", "gloo"),
                    help="gloo (CPU processes), nccl (CUDA processes) or threaded (ranks as threads); "
                         "a comma-separated list runs every test once per backend. "
                         "Default: $SHARDCHECK_BACKEND or gloo.")
    group.addoption("--shardcheck-launch", dest="shardcheck_launch",
                    default=os.environ.get("SHARDCHECK_LAUNCH", "pool"), choices=("pool", "spawn"),
                    help="pool: persistent rank processes reused across tests (default); "
                         "spawn: fresh processes for every test.")
    group.addoption("--shardcheck-rank-timeout", dest="shardcheck_rank_timeout", type=float,
                    default=RANK_TIMEOUT_S, metavar="SECONDS",
                    help="per-test deadline in seconds when neither @distributed(timeout=) nor "
                         f"pytest-timeout gives one (default {RANK_TIMEOUT_S:g}).")
    group.addoption("--shardcheck-world-sizes", dest="shardcheck_world_sizes", default=None,
                    help="comma-separated world sizes to keep, e.g. 2,4 (others are deselected).")
    parser.addini("rank_preload", type="linelist", default=[],
                  help="modules imported in the parent before any rank process starts: forked ranks "
                       "inherit them, a forkserver preloads them (instead of every rank of every pool "
                       "importing them again)")
    group = parser.getgroup("shardcheck-conformance", "shardcheck conformance: implementations")
    group.addoption("--shardcheck-impl", dest="shardcheck_impl", action="append", default=None,
                    help=f"implementation(s) to check: a built-in name ({', '.join(BUILTIN)}), "
                         "NAME[variant], 'all' (every built-in one and variant whose dependencies "
                         "are installed), an entry point of group 'shardcheck.adapters', or "
                         "pkg.module:attr. Repeatable. Default: $SHARDCHECK_IMPL or reference.")
    group.addoption("--shardcheck-model", dest="shardcheck_model", action="append", default=None,
                    metavar="FACTORY[|batches=FN][|wrap=CLASS,...]",
                    help="your own model in the family models: pkg.module:factory returning an nn.Module "
                         "(docs/models.md). Repeatable.")
    group.addoption("--shardcheck-report", default=None, metavar="PATH",
                    help="write a JSON conformance report to PATH (cells stream to PATH + 'l' as JSON lines)")
    group.addoption("--shardcheck-split", dest="shardcheck_split", default=None, type=_split, metavar="K/N",
                    help="run part K of N of the selected cells, balanced by the durations earlier reports "
                         "recorded (the same parts on every machine); `shardcheck report merge` joins the parts' reports")
    group.addoption("--shardcheck-durations", dest="shardcheck_durations", action="append", default=None,
                    metavar="REPORT", help="reports whose cells' durations balance --shardcheck-split (repeatable; "
                                           "default: reports/*.json of the implementations checked; none: by count)")


def _split(text: str):
    import argparse

    from shardcheck.conformance.report import split

    try:
        return split.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def pytest_plugin_registered(plugin, manager):
    _teach_gpus(manager)


def _teach_gpus(manager) -> None:
    """`-n gpus` (shardcheck/harness/xdist_support.py), once pytest-xdist is registered."""
    if _parser and manager.hasplugin("xdist"):
        from shardcheck.harness import xdist_support

        xdist_support.teach_gpus(_parser[0])


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "distributed(world_size=2, backend=None, timeout=None): run the test body on "
                   "world_size ranks (an int or a list: one item per size); the body takes `ctx`.")
    config.addinivalue_line("markers", "requires(*capabilities): capabilities the cell needs")
    config.addinivalue_line("markers", "rank_preload(*modules): modules the test's ranks import, imported once "
                                       "in the parent as `rank_preload` when the test is selected")
    asked = asked_for(config)
    if asked or _collects_the_package(config):
        use(config, asked=asked)


def asked_for(config) -> bool:
    """One of the options on the command line (or in PYTEST_ADDOPTS), `-n gpus`, or ranks started
    by a launcher."""
    env = os.environ
    launched = "TORCHELASTIC_RUN_ID" in env or (env.get("SHARDCHECK_LAUNCHER") == "srun" and "SLURM_PROCID" in env)
    teacher = sys.modules.get("shardcheck.harness.xdist_support")  # imported where xdist is
    gpus = teacher is not None and teacher.header_line() is not None
    return launched or gpus or OPTION_PREFIX in env.get("PYTEST_ADDOPTS", "") or any(
        str(arg).startswith(OPTION_PREFIX) for arg in config.invocation_params.args)


def _collects_the_package(config) -> bool:
    """The session's arguments (or testpaths) name the shardcheck package or a path inside it."""
    for arg in config.args:
        name = str(arg).split("::")[0]
        if name == "shardcheck" or name.startswith("shardcheck."):
            return True
        path = Path(config.invocation_params.dir, name).resolve()
        if path == HERE or HERE in path.parents:
            return True
    return False


def use(config, asked: bool = False) -> None:
    """Register the three plugins (idempotent); their pytest_configure runs now. `asked`: the session
    asked for shardcheck (asked_for), which the harness's header line says; kept in the session's
    state (shardcheck/session_state.py) that the plugins share."""
    from shardcheck import session_state

    session_state.of(config).asked |= asked
    for name, module in PLUGINS.items():
        if not config.pluginmanager.has_plugin(name):
            __import__(module)
            config.pluginmanager.register(sys.modules[module], name)


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makeitem(collector, name, obj):
    """A `@distributed` test (on itself, its class or module): the plugins before its items are made."""
    config = collector.config
    if config.pluginmanager.has_plugin("shardcheck-harness"):
        return
    marks = getattr(obj, "pytestmark", [])
    if any(m.name == "distributed" for m in (marks if isinstance(marks, list) else [marks])) or \
            collector.get_closest_marker("distributed") is not None:
        use(config)
