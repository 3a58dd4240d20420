"""Putting a communication hook on a NON-root unit without registration (seed 004's
`test_registering_hook_submodules` sets `submodules[1]._comm_hook` directly).

The adapter protocol's `register_comm_hook` refuses non-root units (as it must), so there is no
protocol way to reach that state. `plant_comm_hook` uses the adapter's own `plant_comm_hook(model,
path, state, hook)` when it has one, and otherwise the two internals it knows: reference_impl's units
(the reference adapter and every mutant) and FSDP1's `_comm_hook` attribute. Anything else is
unsupported (never a pass).
"""

from __future__ import annotations

from typing import Any, Callable

import torch.nn as nn

from shardcheck.conformance.protocol.outcomes import Unsupported


def plant_comm_hook(impl, model: nn.Module, path: str, state: Any, hook: Callable) -> None:
    if hasattr(impl, "plant_comm_hook"):
        impl.plant_comm_hook(model, path, state, hook)
        return
    try:
        from shardcheck.reference_impl.sharding import unit_of

        unit = unit_of(model.get_submodule(path))
    except (ImportError, AttributeError):
        unit = None
    if unit is not None:
        unit.comm_hook = hook  # the seed sets the hook only, not its state
        return
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    for name, module in model.named_modules():
        if isinstance(module, FSDP) and name.replace("_fsdp_wrapped_module.", "").removesuffix("_fsdp_wrapped_module").rstrip(".") == path:
            module._comm_hook = hook
            return
    raise Unsupported(f"{getattr(impl, 'name', impl)}: no way to put a comm hook on the non-root unit {path!r} "
                      "(the adapter has no plant_comm_hook)")
