"""pytest -p pairwise_cells: of each check function's cells, keep a subset that holds every pair of
its parameters' values (and so every value) at least once; deselect the others.

For a run that must reach every code path of the check bodies, not judge every cell again (the
device guard's run, tests/conformance/test_device_placement.py): a branch of a body or of what it
calls is taken on a parameter's value, or on two values together, and every such combination runs.
Cells the implementation cannot run (a capability it does not declare: unsupported, skipped at
setup) stay and cover nothing. A function with one parameter keeps all its cells; one without
parameters, its cell.
"""

from __future__ import annotations

import itertools

import pytest

from shardcheck.conformance.plugins.selection import required_capabilities

SKIPPED_PARAMS = {"impl", "world_size", "shardcheck_backend"}  # constant within a selected run


def _covers(item, skipped: frozenset | set = SKIPPED_PARAMS) -> set:
    params = getattr(item, "callspec", None) and item.callspec.params or {}
    values = sorted((k, repr(v)) for k, v in params.items() if k not in skipped)
    return {()} | {(kv,) for kv in values} | set(itertools.combinations(values, 2))  # (): the cell itself


def _runs(item) -> bool:
    impl = getattr(item, "callspec", None) and item.callspec.params.get("impl")
    return impl is None or required_capabilities(item) <= set(impl.capabilities)


def covering(items: list, skipped: frozenset | set = SKIPPED_PARAMS) -> list:
    """The items kept, in collection order: greedily, the cell that covers most pairs not yet held
    (of the parameters but `skipped`)."""
    groups: dict = {}
    for item in items:
        groups.setdefault((item.path, item.originalname), []).append(item)
    kept = set()
    for group in groups.values():
        runnable = [i for i in group if _runs(i)]
        kept |= {id(i) for i in group if i not in runnable}
        covers = {id(i): _covers(i, skipped) for i in runnable}
        todo = set().union(*covers.values()) if runnable else set()
        while todo:
            best = max(runnable, key=lambda i: len(covers[id(i)] & todo))
            kept.add(id(best))
            todo -= covers[id(best)]
    return [i for i in items if id(i) in kept]


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    kept = covering(items)
    dropped = [i for i in items if i not in kept]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    print(f"\npairwise_cells: {len(kept)} of {len(items)} cells hold every pair of their parameters' values")
    items[:] = kept
