"""How a unit's forward hooks meet torch.compile: they run eagerly, as FSDP2's do by default.

FSDP2 wraps its pre- and post-forward hooks in ``torch._dynamo.disable`` while
``torch._dynamo.config.skip_fsdp_hooks`` is set (its default): a compiled layer's graph holds the
layer's own compute, and the gathers, frees and saved-tensor hooks around it stay Python. The reference
does the same. Traced instead, every hook is a run of graph breaks that dynamo compiles again per
frame (18 frames a rank for a two-layer model, 7 seconds of CPU a cell): correct, only slow.

The wrap needs dynamo, whose import costs about a second of CPU; a process that never compiles never
imports it. So the hooks are wrapped only when dynamo is already imported when the model is sharded
(every compiling program has by then: ``torch.compile`` and ``nn.Module.compile`` import it). A model
sharded first and compiled afterwards has its hooks traced: slower, the same numbers.
"""
from __future__ import annotations

import sys
from typing import Callable

import torch.nn as nn

REASON = "shardcheck's reference: a unit's gather and free hooks run eagerly, as FSDP2's (skip_fsdp_hooks)"


def eager_under_compile(*hooks: Callable) -> tuple[Callable, ...]:
    """``hooks``, each made to run eagerly inside a compiled frame when dynamo is imported; as they are if not."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None:
        return hooks
    return tuple(dynamo.disable(hook, reason=REASON) for hook in hooks)


def register_forward_hooks(module: nn.Module, before: Callable, after: Callable) -> None:
    """``before`` as ``module``'s forward pre-hook (with kwargs), ``after`` as its forward hook (always
    called), both eager under compile."""
    pre, post = eager_under_compile(before, after)
    module.register_forward_pre_hook(pre, with_kwargs=True)
    module.register_forward_hook(post, always_call=True)
