"""The mechanism every mutant shares: a ReferenceAdapter that patches reference_impl on arrival.

A mutant is applied by replacing a function, method or module global of ``reference_impl`` (the
process-global module objects every rank imports). It must be in effect in whichever process the
adapter lands in:

* the pytest parent builds the adapter (``shardcheck.conformance.plugins.selection`` calls the class): ``__init__``
  patches, and a forked rank pool inherits the patched modules;
* a rank that receives the adapter by pickle (pool or spawn) runs ``__setstate__``, which patches
  again (idempotent: once per process);
* threaded ranks share the parent's modules.

``__getstate__`` returns a non-empty dict on purpose: pickle skips ``__setstate__`` when the state is
None (an instance without attributes), and the patch would then silently not happen in a spawned rank.

Patches are never undone: a process that loaded one mutant is a mutant process. Run each mutant in its
own pytest process (``tests/conformance/test_mutants.py`` does); loading two different mutants in one
process raises instead of silently stacking them.
"""

from __future__ import annotations

import threading
from typing import Any

from shardcheck.conformance.adapters.reference import ReferenceAdapter

_LOCK = threading.Lock()
_APPLIED: dict[str, str] = {}  # "mutant" -> name of the mutant applied in this process


def replace(owner: Any, attr: str, value: Any) -> Any:
    """``setattr(owner, attr, value)``; returns the original, which must exist (a typo in a patch
    target would otherwise add a dead attribute and leave the reference unmutated)."""
    if not hasattr(owner, attr):
        raise AttributeError(f"mutant patch target {owner!r}.{attr} does not exist")
    original = getattr(owner, attr)
    setattr(owner, attr, value)
    return original


def before_shard(prepare: Any) -> None:
    """Patch ``reference_impl.shard`` so that ``prepare(module)`` runs on each module just before it
    is sharded (the unit's sub-units already are): what a wrapper does to a model as it takes it."""
    import shardcheck.reference_impl as ri

    original = ri.shard

    def shard(module, **kwargs):
        prepare(module)
        return original(module, **kwargs)

    replace(ri, "shard", shard)


def untie_shared(module: Any, fresh: Any) -> None:
    """Every module holding a Parameter that a module before it (in ``module.modules()`` order) holds
    too gets ``fresh(p)`` instead, a Parameter of its own, where ``fresh`` returns one (None: stays tied)."""
    seen = set()
    for m in module.modules():
        for name, p in list(m._parameters.items()):
            if p is None:
                continue
            if id(p) not in seen:
                seen.add(id(p))
            elif (own := fresh(p)) is not None:
                m._parameters[name] = own


def accepting_non_root(original: Any) -> Any:
    """``original(module, ...)``, a root-only entry point of reference_impl, with its root check
    missing: a non-root unit is treated as a root for the call, so the call covers only its subtree."""
    from shardcheck.reference_impl.sharding import unit_of

    def accepting(module, *args, **kwargs):
        unit = unit_of(module)
        if unit is None or unit.is_root:
            return original(module, *args, **kwargs)
        unit.is_root = True  # the missing check: a sub-unit is treated as a root
        try:
            return original(module, *args, **kwargs)
        finally:
            unit.is_root = False

    return accepting


class Proxy:
    """Stands in for a module inside one reference_impl module (``clip.dist``, ``clip.torch``): the
    attributes given here replace the real ones, everything else is the real module's."""

    def __init__(self, real: Any, **overrides: Any) -> None:
        self._real = real
        self.__dict__.update(overrides)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class MutantAdapter(ReferenceAdapter):
    """Base of all mutants: the reference adapter with ``patch()`` applied in every process."""

    name = "mutant-base"
    bug = ""  # the bug class, one line (the catalogue's column)
    checks: tuple[str, ...] = ()  # check functions expected to kill it: "test_file.py::test_function"
    survivor: str | None = None  # set when the checks are KNOWN not to kill it: why (a gap to close)
    world_sizes: tuple[int, ...] = (2,)  # the world sizes its runs keep (--world-sizes)
    # Optional: globs ("test_fn[*-accumulate-*]", `*` the only wildcard) over the cells of `checks`
    # that must fail; set, its run goes through every cell and every other one must pass.
    cells: tuple[str, ...] = ()
    # Optional, for the family sharding: the promise rows (shardcheck/conformance/measure/promises.py) its killing
    # cells must break, exactly: a liar caught by the row made for it, not by accident of another.
    rows: tuple[str, ...] = ()

    def __init__(self) -> None:
        self._activate()

    def __getstate__(self) -> dict:
        return {"mutant": self.name}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._activate()

    def _activate(self) -> None:
        with _LOCK:
            applied = _APPLIED.get("mutant")
            if applied == self.name:
                return
            if applied is not None:
                raise RuntimeError(f"mutant {self.name} loaded into a process already running mutant "
                                   f"{applied}: patches are process-global, run one mutant per process")
            self.patch()
            _APPLIED["mutant"] = self.name

    def patch(self) -> None:  # pragma: no cover - every mutant overrides it
        raise NotImplementedError


def applied() -> str | None:
    """The mutant applied in this process, if any."""
    return _APPLIED.get("mutant")
