"""All-gather extensions: let a parameter's local shard choose what is communicated.

A local shard ``t`` (what :func:`shardcheck.reference_impl.local_shard` returns -- the registered sharded
``nn.Parameter`` itself) may define, on its class (tensor subclass) or on the object itself
(monkey patch), the same pair of hooks that ``torch.distributed.fsdp.fully_shard`` accepts::

    t.fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy)  # or (mesh), or ()
        -> (tuple_of_tensors, metadata)
    t.fsdp_post_all_gather(outputs, metadata, param_dtype, *, out=None)
        -> (unsharded_tensor, tensors_to_free)  or  None when ``out`` is given

Every tensor the pre hook returns is sharded on dim 0 like the parameter: it must have either this
rank's number of rows or the padded ``ceil(n / ws)`` rows.  The inputs of a unit's parameters are
all-gathered together (one all-gather per dtype, as FSDP2 gathers a unit), each cut to ``n`` rows
and handed to its post hook.  The first all-gather produces the unsharded tensor; later
ones pass it back as ``out=`` so the hook can refill it.  ``param_dtype`` is the mixed-precision
``param_dtype`` (else the shard's dtype).
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from .collectives import Slot, all_gather_rows_many, group_rank, group_size


def has_extension(t: torch.Tensor) -> bool:
    pre, post = hasattr(t, "fsdp_pre_all_gather"), hasattr(t, "fsdp_post_all_gather")
    if pre != post:
        raise AssertionError(f"define both fsdp_pre_all_gather and fsdp_post_all_gather: {type(t)}")
    return pre


def _bound(t: torch.Tensor, name: str) -> Callable:
    """The hook with ``self`` bound: a class method already is; a function patched onto the
    instance is not (``t.f = f`` stores a plain function), so bind it here."""
    fn = getattr(t, name)
    return fn if inspect.ismethod(fn) else functools.partial(fn, t)


def call_pre_all_gather(t: torch.Tensor, slot: Slot, mesh, module, mp_policy) -> tuple[tuple[torch.Tensor, ...], Any]:
    """Call the pre hook in whichever signature it has; ``outer_size``/``outer_stride`` describe the
    UNSHARDED parameter (as FSDP2 passes them), so a hook can compute its padding."""
    fn = _bound(t, "fsdp_pre_all_gather")
    arity = len(inspect.signature(fn).parameters)
    if arity == 0:
        return fn()
    if arity == 1:  # legacy (self, mesh)
        return fn(mesh)
    if arity == 5:
        return fn(mesh, slot.shape, torch.empty(slot.shape, device="meta").stride(), module, mp_policy)
    raise TypeError(f"fsdp_pre_all_gather takes (mesh, outer_size, outer_stride, module, mp_policy); got {inspect.signature(fn)}")


def call_post_all_gather(t, outputs, metadata, param_dtype, out=None):
    fn = _bound(t, "fsdp_post_all_gather")
    if out is None:
        return fn(outputs, metadata, param_dtype)
    return fn(outputs, metadata, param_dtype, out=out)


def check_inputs_agree(entries, group, device) -> None:
    """Raise on EVERY rank if any rank's pre hook raised or returned wrongly sized inputs.

    ``entries``: one ``(inputs, slot, local_rows, error)`` per parameter gathered together. Each
    rank checks its own inputs (dim 0 must be ``local_rows`` or ``slot.chunk``) and hashes their
    trailing shapes; one small all-reduce (MIN of ``[ok, sig, -sig]``) tells every rank whether all
    ranks are fine and agree.  Raising only where the check fails would leave the other ranks
    blocked in the all-gather that follows.
    """
    ok = all(error is None and all(x.dim() > 0 and x.shape[0] in (local_rows, slot.chunk) for x in inputs)
             for inputs, slot, local_rows, error in entries)
    sig = hash(tuple((len(inputs), tuple((tuple(x.shape[1:]), x.element_size()) for x in inputs))
                     for inputs, _, _, _ in entries)) % (2**31)
    flags = torch.tensor([int(ok), sig, -sig], dtype=torch.int64, device=device)
    if group_size(group) > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=group)
    for _, _, _, error in entries:
        if error is not None:
            raise error
    if flags[0].item() == 0 or flags[1].item() != -flags[2].item():
        got = [tuple(x.shape) for inputs, _, _, _ in entries for x in inputs]
        raise ValueError(
            "fsdp_pre_all_gather returned inputs of the wrong size on some rank: each input must have "
            "dim 0 equal to the local rows or the padded rows (ceil(rows / shards)), and all ranks must "
            f"agree on trailing shapes; this rank's local rows {[e[2] for e in entries]}, padded "
            f"{[e[1].chunk for e in entries]}, got {got}"
        )


class ExtensionGather:
    """The memory of one parameter with all-gather extensions between gathers.

    The all-gather output buffers are kept and refilled on every all-gather, and the unsharded
    tensor from the first post hook is passed back as ``out=``, so a hook may rely on ``out``
    aliasing the fresh outputs (as FSDP2 guarantees).  Simplification: these buffers are not freed
    between steps (``tensors_to_free`` is ignored); the reference is about numbers, not memory.
    """

    def __init__(self) -> None:
        self.buffers: Optional[list[torch.Tensor]] = None
        self.unsharded: Optional[torch.Tensor] = None

    def unshard(self, shard: torch.Tensor, slot: Slot, gathered, metadata, param_dtype) -> torch.Tensor:
        """Refill the kept buffers with the all-gathered inputs, then the post hook."""
        if self.buffers is None or [(b.shape, b.dtype) for b in self.buffers] != [(g.shape, g.dtype) for g in gathered]:
            self.buffers, self.unsharded = list(gathered), None
        else:
            for b, g in zip(self.buffers, gathered):
                b.copy_(g)
        outputs = tuple(b[: slot.rows] for b in self.buffers)
        if self.unsharded is None or self.unsharded.dtype != param_dtype:  # out= only for the same dtype
            self.unsharded, _to_free = call_post_all_gather(shard, outputs, metadata, param_dtype)
        else:
            call_post_all_gather(shard, outputs, metadata, param_dtype, out=self.unsharded)
        return self.unsharded


def all_gather_with_extensions(params, group, *, device, param_dtypes, mesh, module, mp_policy) -> list[torch.Tensor]:
    """``pre hooks -> one size check -> all-gather -> post hooks`` for a unit's parameters with
    extensions (each with ``shard``, ``slot`` and ``extension``, an :class:`ExtensionGather`);
    returns their unsharded tensors.  Every input of every hook travels in one all-gather per
    dtype (:func:`all_gather_rows_many`); ``mesh``, ``module`` and ``mp_policy`` go to the pre hooks."""
    rank, entries, metadatas = group_rank(group), [], []
    for p in params:
        start, end = p.slot.local_rows(rank)
        try:  # a hook that raises on one rank must fail every rank, not leave them in the all-gather
            inputs, metadata = call_pre_all_gather(p.shard, p.slot, mesh, module, mp_policy)
            inputs, error = tuple(x.to(device) for x in inputs), None
        except Exception as exc:
            inputs, metadata, error = (), None, exc
        entries.append((inputs, p.slot, end - start, error))
        metadatas.append(metadata)
    check_inputs_agree(entries, group, device)
    flat = [(x, slot) for inputs, slot, _, _ in entries for x in inputs]
    gathered = iter(all_gather_rows_many([x for x, _ in flat], [s for _, s in flat], group))
    return [p.extension.unshard(p.shard, p.slot, [next(gathered) for _ in inputs], metadata, dtype)
            for p, (inputs, _, _, _), metadata, dtype in zip(params, entries, metadatas, param_dtypes)]
