"""The harness's pytest plugin (registered by shardcheck.pytest_plugin, the entry point, when a session
uses shardcheck): turns `@distributed` tests into N-rank runs; its options are declared there.

- `pytest_generate_tests` makes one item per world size (`[ws2]`, `[ws4]`, ...).
- `pytest_runtest_setup` makes the test's plan (shardcheck/harness/plan.py), once: bad input is one error line,
  a backend or device count this machine lacks is a skip with the reason.
- `pytest_pyfunc_call` ships the item's parameters to the ranks, runs the body there and turns the
  ranks' verdict into the item's outcome; records from the ranks land in `item.user_properties`, with
  the collectives each rank issued (`COLLECTIVES_PROPERTY`).
- `pytest_timeout_set_timer` (pytest-timeout's hook) hands a distributed test's limit to the harness:
  the body gets the whole limit, pool start-up is not counted (shardcheck/harness/deadline.py).
- `pytest_runtest_teardown` and, after the last test, `pytest_runtestloop` report, against the test
  that ran last on it, a rank that died while idle between tests, as an error of that test's
  teardown, as soon as it is found: no run ends green with such a death unreported.
"""

from __future__ import annotations

import os
import pickle
import sys

import pytest

# Nothing here imports torch: a session whose tests are not `@distributed` pays for none of it
# (the rank machinery, shardcheck.harness.runner and shardcheck.harness.pool, is imported by the first distributed test).
from shardcheck.harness import collector, deadline, devices, forked_compat, xdist_support
from shardcheck.harness.launcher import detect
from shardcheck.harness.plan import HarnessUsageError, Plan, check_backend, check_world_size, choose_mode, make_plan
from shardcheck.harness.task import Task, takes_ctx
from shardcheck.harness.verdict import Verdict, not_started
from shardcheck.session_state import Harness, harness_of, of

MARKER = "distributed"
# a distributed item's user property: {rank: {group: {kind: calls}}}, the collectives each rank issued
COLLECTIVES_PROPERTY = "collectives"
PLAN = pytest.StashKey[Plan]()  # a distributed item's plan, made at setup


def _runner():
    """shardcheck.harness.runner (imports torch), on first use."""
    from shardcheck.harness import runner

    return runner


def _started() -> bool:
    """Whether any distributed test ran in this process (its pools may need stopping)."""
    return "shardcheck.harness.runner" in sys.modules


def _size(text: str) -> int:
    if not text.strip().isdigit():
        raise HarnessUsageError(f"--shardcheck-world-sizes: {text.strip()!r} is not a positive integer "
                                f"(give a comma-separated list, e.g. 2,4)")
    return int(text)


def pytest_configure(config):
    collector.fewer_collections()  # before the tests import torch (shardcheck/harness/collector.py)
    try:
        backends = tuple(check_backend(b.strip()) for b in config.getoption("shardcheck_backend").split(","))
        sizes = config.getoption("shardcheck_world_sizes")
        kept = frozenset(check_world_size(_size(s)) for s in sizes.split(",")) if sizes else None
    except HarnessUsageError as exc:
        raise pytest.UsageError(str(exc)) from None
    launch, main_pid = detect(), os.getpid()
    forked_compat.install()  # --forked on pytest >= 9.2 (see shardcheck/harness/forked_compat.py)
    # the controller leases; xdist workers inherit its environment
    lease_dir = None if hasattr(config, "workerinput") else devices.prepare()
    of(config).harness = Harness(backends, kept, launch, main_pid, lease_dir)


def _preload(config) -> None:
    """Before the first distributed test of this process: import `rank_preload` once. It is for
    ranks forked from this process (pools) or run in it (threads); not for a launcher's rank (no
    rank is forked from it; what its tests need, they import)."""
    state = of(config)
    if state.preloaded or harness_of(config).launch is not None:
        return
    from shardcheck.harness.pool import preload

    preload(config.getini("rank_preload"))
    collector.freeze_the_long_lived()  # the preloaded modules too, before ranks fork from here
    state.preloaded = True


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    """What is loaded by now (torch, the plugins, the collected tests) stays for the session's life:
    frozen, the full collections that follow (pytest's own two as the session ends, each walking
    everything torch made) stop walking it. Ranks do the same with what they inherit (worker.py).
    The selected tests' `rank_preload(*modules)` marks join the ini option's modules (imported at
    the first distributed test, before any rank forks)."""
    preloaded = set(session.config.getini("rank_preload"))
    for item in session.items:
        for mark in item.iter_markers("rank_preload"):
            for module in mark.args:
                if module not in preloaded:
                    session.config.addinivalue_line("rank_preload", module)
                    preloaded.add(module)
    collector.freeze_the_long_lived()


@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session):
    launch = harness_of(session.config).launch
    if launch is not None and launch.rank != 0:  # only rank 0 reports under torchrun/srun
        reporter = session.config.pluginmanager.getplugin("terminalreporter")
        if reporter is not None:  # keep the plugin (others use it), silence its output
            from _pytest.config import create_terminal_writer

            reporter._tw = create_terminal_writer(session.config, open(os.devnull, "w"))


def pytest_report_header(config):
    """The harness's line when the session asked for shardcheck (an option, a launcher), and `-n gpus`'s."""
    lines = []
    state = of(config)
    if state.asked:
        launch = harness_of(config).launch
        where = (f"{launch.launcher} rank {launch.rank}/{launch.world_size}" if launch
                 else config.getoption("shardcheck_launch"))
        lines.append(f"shardcheck harness: backend={','.join(harness_of(config).backends)} launch={where}")
    gpus = xdist_support.header_line()
    return lines + [gpus] if gpus else lines or None


@pytest.fixture
def world_size(request):
    """The number of ranks of a `@distributed` test (parametrized by the plugin)."""
    return getattr(request, "param", None)


@pytest.fixture
def shardcheck_backend(request):
    """The backend of a `@distributed` test, when several were asked for (parametrized)."""
    return getattr(request, "param", None)


@pytest.fixture
def ctx(world_size, shardcheck_backend):
    """Placeholder in the parent; on each rank the body receives the real `harness.RankContext`."""
    return None


def pytest_generate_tests(metafunc):
    marker = metafunc.definition.get_closest_marker(MARKER)
    if marker is None:
        return
    sizes = marker.kwargs.get("world_size", marker.args[0] if marker.args else 2)
    sizes = list(sizes) if isinstance(sizes, (list, tuple)) else [sizes]
    names = _backends_for(marker, metafunc.config)
    for name in ("world_size", "shardcheck_backend"):
        if name not in metafunc.fixturenames:
            metafunc.fixturenames.append(name)
    if len(names) == 1:
        metafunc.parametrize("world_size", sizes, ids=[f"ws{s}" for s in sizes])
    else:
        pairs = [(s, b) for b in names for s in sizes]
        metafunc.parametrize(("world_size", "shardcheck_backend"), pairs,
                             ids=[f"ws{s}-{b}" for s, b in pairs])


def pytest_collection_modifyitems(config, items):
    keep = harness_of(config).sizes
    if keep is None:
        return
    selected, deselected = [], []
    for item in items:
        ws = _world_size(item)
        (deselected if ws is not None and ws not in keep else selected).append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = selected


def _world_size(item):
    if item.get_closest_marker(MARKER) is None:
        return None
    return getattr(item, "callspec", None) and item.callspec.params.get("world_size")


def _backends_for(marker, config) -> list[str]:
    fixed = marker.kwargs.get("backend")
    if fixed:
        return [fixed] if isinstance(fixed, str) else list(fixed)
    return list(harness_of(config).backends)


def backend_of(item) -> str:
    """The backend a `@distributed` test item runs on."""
    chosen = item.callspec.params.get("shardcheck_backend")
    return chosen or _backends_for(item.get_closest_marker(MARKER), item.config)[0]


def _deadline(item) -> float:
    """The body's limit: @distributed(timeout=), else pytest-timeout's, else --rank-timeout."""
    own = item.get_closest_marker(MARKER).kwargs.get("timeout")
    return deadline.limit(item, own, item.config.getoption("shardcheck_rank_timeout"))


def _times_itself(item) -> bool:
    """The harness enforces the limit of distributed tests it runs (not under torchrun/srun)."""
    return item.get_closest_marker(MARKER) is not None and harness_of(item.config).launch is None


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_timeout_set_timer(item, settings):
    """pytest-timeout's hook: a distributed test's limit is the harness's to enforce (with every
    rank's stack), on the body only; see shardcheck/harness/deadline.py."""
    if _times_itself(item) and deadline.take_over(item, settings):
        return True
    return None


def _make_plan(item) -> Plan:
    backend = backend_of(item)
    mode = choose_mode(backend, item.config.getoption("shardcheck_launch"),
                       external=harness_of(item.config).launch is not None)
    return make_plan(_world_size(item), backend, mode)


def pytest_runtest_setup(item):
    if item.get_closest_marker(MARKER) is None:
        return
    problem = None
    try:
        plan = item.stash[PLAN] = _make_plan(item)
    except HarnessUsageError as exc:
        problem = str(exc)
    if problem:
        pytest.fail(problem, pytrace=False)
    if takes_ctx(item.obj) is None:
        pytest.fail(f"{item.name}: a @distributed test body must take `ctx` as an argument", pytrace=False)
    if plan.skip:
        pytest.skip(plan.skip)
    _preload(item.config)  # before the first pool forks, or the first threaded world runs


def _unpicklable(kwargs):
    for name, value in kwargs.items():
        try:
            pickle.dumps(value)
        except Exception as exc:
            yield name, exc


def _qualname(item) -> str:
    """Where the ranks find the body: the attribute pytest collected (a generated function such as
    parameterized.expand's has its own attribute but the wrapped function's __qualname__)."""
    owner = f"{item.cls.__qualname__}." if item.cls is not None else ""
    return owner + item.originalname


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    if pyfuncitem.get_closest_marker(MARKER) is None:
        return None
    from shardcheck.harness.pool import PoolStartError

    plan = pyfuncitem.stash[PLAN]
    names = [n for n in pyfuncitem._fixtureinfo.argnames
             if n not in ("ctx", "request", "shardcheck_backend")]
    kwargs = {n: pyfuncitem.funcargs[n] for n in names if n in pyfuncitem.funcargs}
    unshippable = [f"{name!r} ({exc})" for name, exc in _unpicklable(kwargs)]
    if unshippable:
        pytest.fail(f"argument {', '.join(unshippable)} cannot be shipped to the ranks; use picklable "
                    f"parameters, or build the object inside the test body", pytrace=False)
    task = Task(test_id=pyfuncitem.nodeid, module=pyfuncitem.module.__name__,
                file=getattr(pyfuncitem.module, "__file__", None),
                qualname=_qualname(pyfuncitem), kwargs=kwargs, sys_path=list(sys.path))
    of(pyfuncitem.config).locations[pyfuncitem.nodeid] = pyfuncitem.location
    try:
        if devices.leasing_applies(plan.backend, plan.mode):
            visible = len(devices.visible_devices())
            if plan.world_size > visible:
                pytest.skip(f"needs {plan.world_size} devices; {visible} visible")
            with devices.lease(plan.world_size, pyfuncitem.config.getoption("shardcheck_rank_timeout"),
                               prefer=_runner().pool_devices(plan.world_size, plan.backend)) as leased:
                verdict = _run_timed(pyfuncitem, task, plan, leased)
        else:
            verdict = _run_timed(pyfuncitem, task, plan, None)
    except devices.LeaseTimeout as exc:
        verdict = Verdict("failed", str(exc), [])
    except PoolStartError as exc:
        verdict = not_started(exc)
    for key, per_rank in verdict.records():
        pyfuncitem.user_properties.append((key, per_rank))
    if verdict.results:
        pyfuncitem.user_properties.append(
            ("rank_outcomes", {r.rank: r.outcome for r in verdict.results}))
        issued = {r.rank: r.collectives["issued"] for r in verdict.results if r.collectives}
        if issued:  # {rank: {group: {kind: calls}}}, as each rank's ledger counted them
            pyfuncitem.user_properties.append((COLLECTIVES_PROPERTY, issued))
    if verdict.outcome == "failed":
        pytest.fail(verdict.message, pytrace=False)
    if verdict.outcome == "skipped":
        pytest.skip(verdict.message)
    return True


def _run_timed(item, task: Task, plan: Plan, leased: list[str] | None) -> Verdict:
    """Start the ranks (not the test's time), then run the body under its deadline, with
    pytest-timeout's timer as a backstop should the harness itself get stuck."""
    from shardcheck.harness.pool import START_TIMEOUT_S

    runner = _runner()
    if plan.mode == "pool":
        runner.prepare(plan.world_size, plan.backend, leased)
    limit = _deadline(item)
    slack = deadline.STOP_SLACK_S + (START_TIMEOUT_S if plan.mode == "spawn" else 0.0)
    with deadline.backstop(item, limit + slack):
        return runner.run_task(task, plan, limit, leased)


def pytest_runtest_teardown(item):
    if not _started():
        return
    if os.getpid() != harness_of(item.config).main_pid:  # pytest-forked child: its pools die with it
        deaths = _runner().shutdown_pools()  # in this child they can only be this test's
        if deaths:
            pytest.fail("; ".join(message for _, message in deaths), pytrace=False)
        return
    for culprit, message in _runner().take_idle_deaths():  # found by this test: reported now
        _report_idle_death(item.session, culprit, message)


@pytest.hookimpl(wrapper=True)
def pytest_runtestloop(session):
    """After the last test: stop the pools and report ranks that died while idle (see module doc)."""
    result = yield
    for culprit, message in _runner().shutdown_pools() if _started() else ():
        _report_idle_death(session, culprit, message)
    return result


def _report_idle_death(session, culprit: str | None, message: str) -> None:
    """A teardown error of the test that ran last on the dead rank (counted: the run fails)."""
    nodeid = culprit or "shardcheck-pool"
    location = of(session.config).locations.get(nodeid, (nodeid, None, nodeid))
    report = pytest.TestReport(nodeid=nodeid, location=location, keywords={}, outcome="failed",
                               longrepr=f"{message}: the death belongs to that test", when="teardown")
    session.config.hook.pytest_runtest_logreport(report=report)


def pytest_unconfigure(config):
    if _started():
        _runner().shutdown_pools()
        _runner().leave_external_world()  # ranks leave together, after rank 0 has reported
    harness = of(config).harness
    devices.finish(harness.lease_dir if harness else None)  # after the workers: no lease is held
