"""Mutants of gradient communication hooks (shardcheck/reference_impl/comm_hooks.py, Unit.communicate)."""

from __future__ import annotations

import importlib

from shardcheck.conformance.mutants.base import MutantAdapter, accepting_non_root, replace


def _modules():
    return importlib.import_module("shardcheck.reference_impl"), importlib.import_module("shardcheck.reference_impl.comm_hooks")


def _root_unit(module):
    """The unit of ``module``, which must be a root: the registration's first check, which the
    rewritten registrations below keep."""
    from shardcheck.reference_impl.sharding import unit_of

    unit = unit_of(module)
    if unit is None or not unit.is_root:
        raise AssertionError("register_comm_hook can only be called on a root instance.")
    return unit


class CommHookIgnored(MutantAdapter):
    """Comm hook registered but never called: the unit keeps using its default reduce-scatter /
    all-reduce (e.g. the hook stored on the wrong object, or a fast path that bypasses it)."""

    name = "mutant-comm-hook-ignored"
    bug = "comm hook registered but the default collective used"
    checks = ("test_comm_hooks.py::test_custom_hook_called",)

    def patch(self) -> None:
        from shardcheck.reference_impl import collectives as C
        from shardcheck.reference_impl.sharding import Unit

        replace(Unit, "communicate",
                lambda self, flat: C.average_gradient(flat, self.shard_group, self.replicate_group, self.divide_factor))


class CommHookReregister(MutantAdapter):
    """A second ``register_comm_hook`` is not rejected: the last registration silently wins."""

    name = "mutant-comm-hook-reregister"
    bug = "second comm hook registration not rejected"
    checks = ("test_comm_hooks.py::test_default_communication_hook_initialization",)

    def patch(self) -> None:
        from shardcheck.reference_impl.sharding import unit_of, units

        ri, hooks = _modules()
        original = hooks.register_comm_hook

        def register_comm_hook(module, state, hook):
            unit = unit_of(module)
            if unit is not None and unit.is_root:
                for u in units(module):
                    u.comm_hook = u.comm_hook_state = None  # the bug: overwrite, don't refuse
            return original(module, state, hook)

        replace(hooks, "register_comm_hook", register_comm_hook)
        replace(ri, "register_comm_hook", register_comm_hook)


class CommHookNonRootAccepted(MutantAdapter):
    """``register_comm_hook`` on a non-root unit accepted (root-ness checked before it is known, as
    when FSDP1's lazy init has not run): the hook covers only that subtree."""

    name = "mutant-comm-hook-non-root-accepted"
    bug = "comm hook registration on a non-root unit not rejected"
    checks = ("test_comm_hooks.py::test_registering_hook_non_root",)

    def patch(self) -> None:
        ri, hooks = _modules()
        register_comm_hook = accepting_non_root(hooks.register_comm_hook)
        replace(hooks, "register_comm_hook", register_comm_hook)
        replace(ri, "register_comm_hook", register_comm_hook)


class CommHookRootOnlyChecked(MutantAdapter):
    """Root registration checks only the ROOT for an existing hook: a hook already on a sub-unit is
    silently replaced (seed 004 ``test_registering_hook_submodules``)."""

    name = "mutant-comm-hook-root-only-checked"
    bug = "root registration ignores a hook already on a sub-unit"
    checks = ("test_comm_hooks.py::test_registering_hook_submodules",)

    def patch(self) -> None:
        from shardcheck.reference_impl.sharding import units

        ri, hooks = _modules()

        def register_comm_hook(module, state, hook):
            unit = _root_unit(module)
            if unit.comm_hook is not None:  # the bug: only the root is checked
                raise AssertionError("A communication hook is already registered")
            for u in units(module):
                u.comm_hook, u.comm_hook_state = hook, state

        replace(hooks, "register_comm_hook", register_comm_hook)
        replace(ri, "register_comm_hook", register_comm_hook)


class CommHookNonAtomic(MutantAdapter):
    """Registration assigns unit by unit while checking (FSDP1's own loop): a refusal because a later
    unit already has a hook leaves the earlier units hooked."""

    name = "mutant-comm-hook-non-atomic"
    bug = "refused root registration leaves earlier units hooked (not all-or-nothing)"
    checks = ("test_comm_hooks.py::test_refused_registration_leaves_no_hook",)

    def patch(self) -> None:
        from shardcheck.reference_impl.sharding import units

        ri, hooks = _modules()

        def register_comm_hook(module, state, hook):
            _root_unit(module)
            for u in units(module):
                if u.comm_hook is not None:
                    raise AssertionError("A communication hook is already registered")
                u.comm_hook, u.comm_hook_state = hook, state  # the bug: assigned before all are checked

        replace(hooks, "register_comm_hook", register_comm_hook)
        replace(ri, "register_comm_hook", register_comm_hook)
