import os
import sys

pytest_plugins = ["pytester"]

# The suite starts some ninety child pytest sessions (mutant runs, fault injection, CLI runs, torchrun
# ranks), which inherit this variable. hypothesis's pytest plugin imports all of hypothesis at the end
# of every session (its pytest_terminal_summary imports hypothesis.internal.observability, hypothesis
# 6.170), and pytest rewrites the asserts of its 60-odd modules, a plugin's: about 1 s of CPU per
# session where bytecode is not cached (PYTHONDONTWRITEBYTECODE), 28 s of the README test command's
# wall time on 2 cores. No child session uses the plugin (shardcheck explore uses hypothesis's API).
NO_HYPOTHESIS_PLUGIN = "-p no:hypothesispytest"
if NO_HYPOTHESIS_PLUGIN not in os.environ.get("PYTEST_ADDOPTS", ""):
    os.environ["PYTEST_ADDOPTS"] = f"{os.environ.get('PYTEST_ADDOPTS', '')} {NO_HYPOTHESIS_PLUGIN}".strip()

# pytest rewrites the asserts of every module of a plugin's distribution, so all of hypothesis (73
# modules, about 1 s of CPU per session where bytecode is not cached) once a test imports it.
# Library code needs none of it; the project's own modules are narrowed in shardcheck/pytest_plugin.py.
for _finder in sys.meta_path:
    if isinstance(getattr(_finder, "_must_rewrite", None), set):
        _finder._must_rewrite.discard("hypothesis")

# The project's property tests judge values, not speed: under three xdist workers on 2 loaded cores a
# draw can take longer than hypothesis's default 250 ms deadline (.ci/run, tests/harness/test_digest.py
# on a busy machine), which would fail a test for the machine's load.
from hypothesis import settings  # noqa: E402

settings.register_profile("shardcheck-tests", deadline=None)
settings.load_profile("shardcheck-tests")


# The README's test command runs the conformance checks on both backends. On gloo every cell runs. On
# threads (the same bodies as threads of one process) each check function keeps the cells that hold
# every pair of its parameters' values, world size included (tests/conformance/pairwise_cells.py):
# what the threaded backend must show is that every body and every pair of values runs there (806
# cells -> 447, about 110 -> 64 CPU-s); the cells' numbers are judged on gloo, and by
# `shardcheck run --backend threaded`. SHARDCHECK_THREADED_CELLS=all keeps every threaded cell.
THREADED_CELLS_ENV = "SHARDCHECK_THREADED_CELLS"


def _threaded_check(item) -> bool:
    params = getattr(item, "callspec", None) and item.callspec.params or {}
    return params.get("shardcheck_backend") == "threaded" and "conformance/checks/" in item.nodeid


def pytest_collection_modifyitems(config, items):
    if os.environ.get(THREADED_CELLS_ENV) == "all":
        return
    from conformance.pairwise_cells import covering

    threaded = [i for i in items if _threaded_check(i)]
    kept = {id(i) for i in covering(threaded, skipped={"impl", "shardcheck_backend"})}
    dropped = {id(i) for i in threaded} - kept
    if dropped:
        config.hook.pytest_deselected(items=[i for i in threaded if id(i) in dropped])
        items[:] = [i for i in items if id(i) not in dropped]
