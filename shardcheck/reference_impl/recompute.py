"""A recomputed forward that runs without the unit's hooks (step 5 of sharding.py, the other way).

Activation checkpointing applied to a module's `forward` rather than to its `__call__` (transformers'
`GradientCheckpointingLayer`, since transformers 5: "module hooks (e.g. FSDP2's) stay outside the
checkpoint") recomputes the forward in backward without running the unit's forward hooks: the
recompute reads the parameters off the modules, where `after_forward` left the shards. The unit's
own saved-tensors hooks were installed around that forward, but checkpointing's, innermost, took
every save of a parameter: none reached `Unit.pack_for_backward`, so no unpack will re-gather the unit. Then, as
FSDP2's pre-backward hook does, the full parameters go back on the modules when the gradient of the
unit's output arrives, before its backward runs; `unsynced.keep_or_reshard` puts the shards back
after the unit's gradients are reduced.

A FULL_SHARD unit whose forward saves no parameter at all (an embedding alone: its backward needs
the indices, not the weight) is taken for such a forward too, and gathers once in backward, as FSDP1
and FSDP2 always do before a unit's backward.

Not handled yet: a unit that keeps its parameters gathered until backward (SHARD_GRAD_OP) holds them,
but not on its modules, and installs no saved-tensors hooks to tell such a forward by: its recompute
still reads the shards (no cell runs SHARD_GRAD_OP under transformers' checkpointing yet).
"""

from __future__ import annotations

import functools

import torch
from torch.utils._pytree import tree_leaves


def before_backward(unit, output) -> None:
    """At the end of a unit's forward (before `after_forward` closes its saved-tensors scope and
    reshards): if the unit's own hooks were installed (FULL_SHARD) and packed no parameter, put the
    full parameters on the modules when the output's gradient arrives. Nothing changes for a forward
    whose saves reached the unit's hooks, or ran inside a checkpoint's (recomputed through them)."""
    packed, unit.packed = unit.packed, False
    if packed or unit.saved_scope is None or not any(p.shard.requires_grad for p in unit.params):
        return
    if any(f is not None and (type(f) is not torch.Tensor or f.is_meta) for f in unit.full or ()):
        return  # parameters pack_for_backward never packs (meta, fake, subclasses): nothing to tell by
    for t in tree_leaves(output):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.register_hook(functools.partial(_on_modules, unit))


def _on_modules(unit, grad):
    """The full parameters on the modules, requiring gradients as the shards do (as in the forward
    recomputed: autograd saves a tensor for backward only where a gradient needs it, and the recompute
    must save what the forward saved)."""
    unit.set_params([f if f is None else f.detach().requires_grad_(p.shard.requires_grad)
                     for f, p in zip(unit.full_for_backward(), unit.params)])
    return grad
