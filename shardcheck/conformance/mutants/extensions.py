"""Mutants of all-gather extensions (shardcheck/reference_impl/extensions.py, Unit.all_gather)."""

from __future__ import annotations

import importlib

from shardcheck.conformance.mutants.base import MutantAdapter, replace


class ExtensionHooksIgnored(MutantAdapter):
    """All-gather extension hooks silently ignored: ``fsdp_pre_all_gather`` /
    ``fsdp_post_all_gather`` are never called and the local shard itself is all-gathered."""

    name = "mutant-ext-hooks-ignored"
    bug = "all-gather extension hooks silently ignored"
    checks = ("test_extensions.py::test_monkey_patch", "test_extensions.py::test_train_parity",
              "test_extensions.py::test_uneven_shards", "test_extensions.py::test_meta_init_end_to_end",
              "test_extensions_subclasses.py::test_subclass_train_parity")

    def patch(self) -> None:
        replace(importlib.import_module("shardcheck.reference_impl.sharding"), "has_extension", lambda t: False)


class ExtensionInstanceHooksIgnored(MutantAdapter):
    """Extension hooks looked up on the tensor's class only: a subclass defining them works, hooks
    monkey-patched onto the local shard object are silently ignored (the same symptom as patching
    FSDP2's ``to_local()``, a fresh view each time: gh-166156)."""

    name = "mutant-ext-instance-hooks-ignored"
    bug = "all-gather hooks patched onto the shard object ignored (class lookup only)"
    # not test_train_parity: its hooks live on a subclass, which a class lookup finds (the old
    # catalogue listed it, but -x stopped at monkey_patch, so that claim was never run)
    checks = ("test_extensions.py::test_monkey_patch",)

    def patch(self) -> None:
        from shardcheck.reference_impl.extensions import has_extension

        replace(importlib.import_module("shardcheck.reference_impl.sharding"), "has_extension",
                lambda t: hasattr(type(t), "fsdp_pre_all_gather") and has_extension(t))


class ExtensionSizeUnchecked(MutantAdapter):
    """Wrongly sized pre-all-gather inputs are not detected: the all-gather pads or crops every
    rank's input to the chunk size, silently dropping (or inventing) rows."""

    name = "mutant-ext-size-unchecked"
    bug = "wrongly sized fsdp_pre_all_gather inputs not detected (silently cropped)"
    checks = ("test_extensions.py::test_wrong_size_raises_on_every_rank",)

    def patch(self) -> None:
        ext = importlib.import_module("shardcheck.reference_impl.extensions")
        original = ext.check_inputs_agree

        def check(entries, group, device):
            if any(error is not None for *_, error in entries):
                return original(entries, group, device)

        replace(ext, "check_inputs_agree", check)


class ExtensionLocalRowsRefused(MutantAdapter):
    """FSDP2's contract (F55): fsdp_pre_all_gather inputs must already be padded to the common row
    count; a hook returning the rank's own rows of an uneven shard is refused (on every rank here,
    as the reference refuses wrong sizes) instead of being padded by the engine."""

    name = "mutant-ext-local-rows-refused"
    bug = "unpadded extension inputs (the rank's own rows) refused instead of padded"
    checks = ("test_extensions.py::test_uneven_shards",)
    cells = ("test_uneven_shards[*-local_rows]",)

    def patch(self) -> None:
        from shardcheck.reference_impl import extensions

        original = extensions.check_inputs_agree

        def padded_only(entries, group, device):
            entries = [(inputs, slot, slot.chunk, error) for inputs, slot, _, error in entries]
            return original(entries, group, device)

        replace(extensions, "check_inputs_agree", padded_only)
