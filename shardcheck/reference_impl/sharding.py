"""Sharded units: the life of a unit's parameters, top to bottom.

A *unit* is a module passed to :func:`shard` with the parameters of its subtree that no
already-sharded sub-unit owns.  With ``W`` ranks in the unit's shard group, each of those
parameters lives through one training step like this:

1. **sharded** (:func:`shard`): a parameter of ``n`` rows keeps only this rank's rows
   ``[r*c, (r+1)*c)`` (clipped to ``n``), ``c = ceil(n / W)`` -- exactly ``torch.chunk(p, W)[r]``.
   That shard *is* the registered ``nn.Parameter``: the optimizer only ever sees shards.
2. **gathered** (:func:`before_forward`): one all-gather per unit gives every rank
   ``full = cat_r(shard_r)`` of every parameter (collectives.py lays the unit out as one flat
   padded buffer; a group of one, NO_SHARD's, uses the shards themselves, no copy).  It runs
   inside :class:`AllGather`, so autograd sees ``full = AllGather(shards)``.
3. **used**: the full tensors replace the shards on the modules; the module's own forward runs unchanged.
4. **freed** (:func:`after_forward`): the shards go back on the modules.  FULL_SHARD and
   HYBRID_SHARD drop the full tensors: whatever autograd saved of them for backward was packed
   as ``(which parameter, size, stride, offset)`` instead (:meth:`Unit.pack_for_backward`).
   SHARD_GRAD_OP keeps them until the unit's backward; NO_SHARD never shards.
5. **re-gathered for backward** (:meth:`Unit.unpack_for_backward`; a recompute without hooks: recompute.py):
   the first backward use of a packed view all-gathers the unit again (once) and cuts the view out.
6. **gradients reduce-scattered and averaged** (:meth:`AllGather.backward`): the adjoint of an
   all-gather is a reduce-scatter, so the full gradients ``g_q`` of every rank ``q`` become
   ``shard_r.grad += (1/W_dp) * sum_q g_q[rows of r]`` (collectives.average_gradient: the mean
   over all data-parallel ranks with torch's pre/post division, or the sum over them divided by a
   ``gradient_divide_factor``), in one collective per unit.
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional

import torch
import torch.nn as nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from shardcheck.compat import in_backward, innermost_saved_tensors_pack, set_grad
from . import buffers, collectives as C, recompute, routed
from .compiled import register_forward_hooks
from .unsynced import gathered, hold, keep_or_reshard, merge_unsynced
from .extensions import ExtensionGather, all_gather_with_extensions, has_extension
from .mixed_precision import MixedPrecision, cast_buffers, cast_floating, compute_dtype, grad_dtype, reduce_dtype
from .topology import ShardingStrategy, compute_device, groups_of


@dataclass
class ShardedParam:
    shard: nn.Parameter  # this rank's rows: registered on the modules, updated by the optimizer
    slot: C.Slot  # unsharded shape and row layout
    uses: list[tuple[nn.Module, str]]  # every (module, attribute name) that holds this parameter
    extension: Optional[ExtensionGather] = None  # state of fsdp_pre/post_all_gather, once used


# -- 1. shard ---------------------------------------------------------------------------------
def shard(
    module: nn.Module,
    *,
    mesh=None,
    process_group=None,
    strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD,
    mixed_precision: Optional[MixedPrecision] = None,
    offload: bool = False,
    gradient_divide_factor: Optional[float] = None,
) -> nn.Module:
    """Make ``module`` a sharded unit (in place; returns it).  Shard sub-modules first, root last.

    ``offload=True`` keeps shards and their gradients on the CPU (a unit whose shards were moved off it
    refuses to gather) and copies shards to the compute device (``mesh.device_type``) for each all-gather.
    ``gradient_divide_factor`` d: the gradients' sum over every data-parallel rank is divided by d.
    """
    if unit_of(module) is not None:
        raise ValueError("module is already sharded")
    shard_group, replicate_group, dp_group = groups_of(strategy, mesh, process_group)
    owned = list(dict.fromkeys(_owned_modules(module)))
    sub_units = [u for m in module.modules() if (u := unit_of(m)) is not None]
    uses: dict[nn.Parameter, list] = {}
    for m in owned:
        for name, p in m._parameters.items():
            if p is not None:
                if any(_was_replaced_by(u, p) for u in sub_units):
                    raise ValueError(f"parameter {name!r} is tied to a parameter of an already-sharded sub-unit; shard their common ancestor only")
                uses.setdefault(p, []).append((m, name))
    device = compute_device(mesh, list(uses))
    sws, srank = C.group_size(shard_group), C.group_rank(shard_group)
    params = []
    for orig, where in uses.items():
        slot = C.Slot.of(orig.shape, sws)
        params.append(ShardedParam(_shard_param(orig, slot, srank, device, offload, mixed_precision), slot, where))
    plain_dtypes = {sp.shard.dtype for sp in params if not is_traceable_wrapper_subclass(sp.shard)}
    if len(plain_dtypes) > 1:
        raise ValueError(f"a unit's parameters must share one dtype, got {plain_dtypes}")
    unit = Unit(module, params, strategy, shard_group, replicate_group, dp_group, mesh, mixed_precision, device, gradient_divide_factor)
    unit.originals, unit.offload = {id(orig): weakref.ref(orig) for orig in uses}, offload
    unit.restore_shards()
    for m in owned:
        cast_buffers(m, mixed_precision)
    for u in sub_units:
        u.is_root = False
    module.__dict__["_sharded_unit"] = unit
    register_forward_hooks(module, before_forward, after_forward)
    return module


def _shard_param(orig: nn.Parameter, slot: C.Slot, rank: int, device, offload: bool, mp) -> nn.Parameter:
    """A new leaf Parameter holding rows ``slot.local_rows(rank)`` of ``orig`` (on the CPU if
    ``offload``); its grad may be in ``reduce_dtype`` under ``keep_low_precision_grads``."""
    with torch.no_grad():
        local = C.shard_rows(orig.detach(), slot, rank).clone()
    if not local.is_meta:
        local = local.cpu() if offload else local.to(device)
    p = nn.Parameter(local, requires_grad=orig.requires_grad)
    if grad_dtype(mp, p.dtype) != p.dtype:
        p.grad_dtype = grad_dtype(mp, p.dtype)
    return p


def _owned_modules(module: nn.Module):
    """``module`` and its descendants, not descending into already-sharded sub-units."""
    yield module
    for child in module.children():
        if unit_of(child) is None:
            yield from _owned_modules(child)


def _was_replaced_by(unit: Unit, p: nn.Parameter) -> bool:
    ref = unit.originals.get(id(p))
    return ref is not None and ref() is p


def unit_of(module: nn.Module) -> Optional[Unit]:
    return module.__dict__.get("_sharded_unit")


def units(module: nn.Module, adopt: bool = True) -> list[Unit]:
    """All units in ``module``'s tree, root first; ``adopt``: re-read the shards from the modules first."""
    found = [u for m in module.modules() if (u := unit_of(m)) is not None]
    for u in found if adopt else ():
        u.adopt_module_params()
    return found


def local_shard(param: nn.Parameter) -> nn.Parameter:
    """The registered shard, all-gathered from (patch its fsdp_pre/post_all_gather after ``to_empty()``)."""
    return param


class SavedView(NamedTuple):
    """What autograd keeps, after forward, of a tensor it saved that is (a view of) the unit's
    full parameter ``index``: enough to cut the same view out of it once it is re-gathered."""

    index: int
    size: torch.Size
    stride: tuple
    offset: int


@dataclass(repr=False)
class Unit:
    """Per-unit state, stored on the module (see :func:`unit_of`)."""

    module: nn.Module
    params: list[ShardedParam]
    strategy: ShardingStrategy
    shard_group: Any  # ranks among which a parameter is split (None: size 1)
    replicate_group: Any  # ranks holding identical shards; gradients are all-reduced over it
    dp_group: Any  # all data-parallel ranks (for clip_grad_norm_)
    mesh: Any
    mp: Optional[MixedPrecision]
    device: torch.device  # where the full parameters live and compute happens
    divide_factor: Optional[float] = None  # the user's gradient divisor (None: the dp world size)
    is_root: bool = True
    comm_hook: Any = None
    comm_hook_state: Any = None
    full: Optional[list[torch.Tensor]] = None  # the full parameters while gathered
    originals: dict = field(default_factory=dict)  # id -> weakref of the replaced unsharded params
    saved_scope: Optional[contextlib.ExitStack] = None  # the forward's saved-tensors hooks
    sync: bool = True  # False inside no_sync(): backward holds gradients (accumulation.py)
    unsynced: Optional[list] = None  # full gradients summed over unsynced backwards
    reshard_after_backward: bool = True  # False: backward keeps the full parameters for the next forward
    kept: Optional[list] = None  # those full parameters (unsynced.py)
    packed: bool = False  # a parameter's view was packed by pack_for_backward in this forward (recompute.py)
    reduce_unused: bool = False  # agree which parameters some rank has a gradient for (routed.py)

    def __repr__(self) -> str:
        return f"Unit({type(self.module).__name__}, {self.strategy.name}, {len(self.params)} params, root={self.is_root})"

    shard_rank = property(lambda self: C.group_rank(self.shard_group))
    shard_size = property(lambda self: C.group_size(self.shard_group))

    @property
    def first_replica(self) -> bool:
        """Whether this rank's shards count for norms (each element once across the dp world)."""
        return C.group_rank(self.replicate_group) == 0

    @property
    def frees_after_forward(self) -> bool:
        return self.strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD) and self.shard_size > 1

    # -- 2. gather ----------------------------------------------------------------------------
    def all_gather(self, param_dtype: Optional[torch.dtype] = None, skip=None) -> list[torch.Tensor]:
        """The full tensors of all owned parameters, in ``param_dtype`` (default: the compute dtype);
        ``None`` for those ``skip`` (one flag per parameter) marks.

        Plain parameters travel in one ``all_gather_single`` of the flat padded layout; a parameter
        with all-gather extensions goes through its hooks."""
        skip = skip or [False] * len(self.params)
        fulls: list[Optional[torch.Tensor]] = [None] * len(self.params)
        plain = [i for i, p in enumerate(self.params) if not skip[i] and not has_extension(p.shard)]
        if plain:
            dtype = param_dtype or compute_dtype(self.mp, self.params[plain[0]].shard.dtype)
            gathered_ = C.all_gather_full([self.params[i].shard for i in plain], [self.params[i].slot for i in plain],
                                          dtype, self.device, self.shard_group, alias=not self.offload)
            for i, full in zip(plain, gathered_):
                fulls[i] = full
        hooked = [i for i, p in enumerate(self.params) if fulls[i] is None and not skip[i]]
        for i in hooked:
            self.params[i].extension = self.params[i].extension or ExtensionGather()
        if hooked:
            unsharded = all_gather_with_extensions(
                [self.params[i] for i in hooked], self.shard_group, device=self.device,
                param_dtypes=[param_dtype or compute_dtype(self.mp, self.params[i].shard.dtype) for i in hooked],
                mesh=self.mesh, module=self.module, mp_policy=self.mp or MixedPrecision())
            for i, full in zip(hooked, unsharded):
                fulls[i] = full
        return fulls

    def unshard(self, differentiable: bool) -> list[torch.Tensor]:
        """All-gather the unit; through :class:`AllGather` when gradients must flow to the shards."""
        self.reshard()
        shards = [p.shard for p in self.params]
        if self.offload and (moved := {str(s.device) for s in shards if not s.is_meta} - {"cpu"}):  # moved after shard()
            raise RuntimeError(f"{self!r} offloads its parameters to the CPU, but they are on {', '.join(sorted(moved))}")
        if differentiable and any(s.requires_grad for s in shards):
            self.full = list(AllGather.apply(self, *shards))
        else:
            with torch.no_grad():
                self.full = gathered(self)
        return self.full

    def reshard(self) -> None:
        """Drop the full parameters (the shards are the only copy again)."""
        self.full = None

    # -- 3. use: full tensors on the modules, and back ----------------------------------------
    def set_params(self, tensors) -> None:
        """Make each parameter's attribute, on every module holding it, the given tensor."""
        for p, t in zip(self.params, tensors):
            for module, name in p.uses:
                set_param(module, name, t)

    def restore_shards(self) -> None:
        self.set_params([p.shard for p in self.params])

    def adopt_module_params(self) -> None:
        """Take the shards from the modules again: ``module.to_empty()`` / ``.to()`` may register new
        Parameter objects (and untie shared ones); the first holder's object wins and is re-tied."""
        for p in self.params:
            module, name = p.uses[0]
            current = module._parameters[name]
            if current is not p.shard and isinstance(current, nn.Parameter) and not hasattr(current, "_full_view"):
                p.shard = current
                for m, n in p.uses:
                    set_param(m, n, current)

    # -- 4./5. free after forward, re-gather in backward --------------------------------------
    def pack_for_backward(self, t: torch.Tensor):
        """saved_tensors_hooks pack: a (view of a) full parameter of this unit is kept as a
        :class:`SavedView` of it, which holds no memory; anything else is kept as is."""
        if self.full is None or type(t) is not torch.Tensor or t.is_meta or t.numel() == 0:
            return t
        storage = t.untyped_storage().data_ptr()
        for i, full in enumerate(self.full):
            if (type(full) is torch.Tensor and full.dtype == t.dtype and full.device == t.device
                    and full.untyped_storage().data_ptr() == storage):
                self.packed = True  # an unpack will re-gather the unit
                return SavedView(i, t.size(), t.stride(), t.storage_offset())
        return t

    def unpack_for_backward(self, saved):
        """saved_tensors_hooks unpack: the same view of the re-gathered full parameter."""
        if isinstance(saved, SavedView):
            full = self.full_for_backward()[saved.index]
            return full.as_strided(saved.size, saved.stride, saved.offset)
        return saved

    def full_for_backward(self) -> list[torch.Tensor]:
        """The full parameters, all-gathered again if they were freed (once per backward: the
        unit's :meth:`AllGather.backward` frees them after their last use)."""
        if self.full is None:
            with torch.no_grad():
                self.full = gathered(self)
        return self.full

    # -- 6. gradients -------------------------------------------------------------------------
    def communicate(self, flat: torch.Tensor) -> torch.Tensor:
        """Average a ``[shard_size * S]`` gradient buffer over the dp world; returns ``[S]``."""
        if self.comm_hook is None:
            return C.average_gradient(flat, self.shard_group, self.replicate_group, self.divide_factor)
        if self.strategy is ShardingStrategy.NO_SHARD:  # all-reduce in place: hook(state, grad)
            self.comm_hook(self.comm_hook_state, flat)
            return flat
        out = torch.zeros(flat.numel() // self.shard_size, dtype=flat.dtype, device=flat.device)
        self.comm_hook(self.comm_hook_state, flat, out)  # sharded: hook(state, grad, output)
        return out

    def reduce_grads(self, grads) -> None:
        """Full gradients -> averaged shard gradients, accumulated into ``shard.grad``: one collective for all plain
        parameters (a missing gradient counts as zeros; None where this rank, or with routed.py every rank, has none), one per extension."""
        keep_or_reshard(self)
        if not self.sync:
            return hold(self, grads)
        grads = merge_unsynced(self, grads)
        plain = [i for i, p in enumerate(self.params) if p.extension is None and p.shard.requires_grad]
        if plain and (self.reduce_unused or any(grads[i] is not None for i in plain)):
            rdtype = reduce_dtype(self.mp, self.params[plain[0]].shard.dtype)
            slots = [self.params[i].slot for i in plain]
            flat = C.pack_full([grads[i] for i in plain], slots, self.shard_size, rdtype, self.device)
            shard_grads = C.unpack_shards(self.communicate(flat), slots, self.shard_rank)
            for i, g, used in zip(plain, shard_grads, routed.used_anywhere(self, [grads[i] is not None for i in plain])):
                if used:
                    _accumulate(self.params[i].shard, g, grad_dtype(self.mp, self.params[i].shard.dtype))
        for p, g in zip(self.params, grads):
            if p.extension is not None and p.shard.requires_grad and g is not None:
                _accumulate(p.shard, self.reduce_one(g, p.slot), grad_dtype(self.mp, p.shard.dtype))

    def reduce_one(self, g: torch.Tensor, slot: C.Slot) -> torch.Tensor:
        """Reduce one full gradient; a wrapper subclass (e.g. TwoTensor) inner tensor by inner tensor."""
        if is_traceable_wrapper_subclass(g):
            start, end = slot.local_rows(self.shard_rank)
            return C.map_inner(g, lambda t: self.reduce_one(t, slot), torch.Size([end - start, *slot.shape[1:]]))
        flat = C.pack_full([g], [slot], self.shard_size, reduce_dtype(self.mp, g.dtype), self.device)
        return C.unpack_shards(self.communicate(flat), [slot], self.shard_rank)[0]


def set_param(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """``module.<name> = tensor``, also for a non-leaf full tensor (an :class:`AllGather` output):
    ``nn.Module.__setattr__`` only accepts Parameters there, so write the registry, as FSDP2 does."""
    module._parameters[name] = tensor


def _accumulate(param: nn.Parameter, grad: torch.Tensor, dtype: torch.dtype) -> None:
    """``param.grad += grad`` in ``param.grad``'s device and dtype (CPU offload, low-precision grads)."""
    grad = grad.to(device=param.device, dtype=dtype)
    if param.grad is not None:
        param.grad += grad
    else:  # a gradient of another dtype or device than param's: set_grad, for releases before 2.10
        set_grad(param, grad)


class AllGather(torch.autograd.Function):
    """``forward``: shards -> full tensors (all-gather).  ``backward``: its adjoint, full
    gradients -> averaged shard gradients (reduce-scatter, see :meth:`Unit.reduce_grads`), written
    into ``shard.grad`` directly so that low-precision and CPU-offloaded gradients keep their dtype
    and device."""

    @staticmethod
    def forward(ctx, unit: Unit, *shards):
        ctx.unit = unit
        ctx.set_materialize_grads(False)
        fulls = gathered(unit)
        ctx.mark_non_differentiable(*[f for f, s in zip(fulls, shards) if not s.requires_grad])
        return tuple(fulls)

    @staticmethod
    def backward(ctx, *grads):
        ctx.unit.reduce_grads(grads)
        return (None,) * (1 + len(grads))


# -- the forward hooks: steps 2 to 4 ----------------------------------------------------------
def before_forward(module: nn.Module, args, kwargs):
    """Gather the unit (a recomputing forward may find it gathered), full parameters on the modules; FULL_SHARD
    then saves through the unit's hooks (closed by :func:`after_forward`), unless checkpointing's are active."""
    unit = unit_of(module)
    unit.adopt_module_params()
    buffers.before_forward(unit)
    if unit.mp is not None:
        args, kwargs = cast_floating((args, kwargs), unit.mp.param_dtype)
    grad, pack = torch.is_grad_enabled(), innermost_saved_tensors_pack()
    kept = unit.full is not None and in_backward()  # recomputed forward (checkpointing): still gathered
    unit.set_params(unit.full if kept else unit.unshard(differentiable=grad))
    if grad and unit.frees_after_forward and (pack is None or isinstance(getattr(pack, "__self__", None), Unit)):
        unit.saved_scope = contextlib.ExitStack()
        unit.saved_scope.enter_context(
            torch.autograd.graph.saved_tensors_hooks(unit.pack_for_backward, unit.unpack_for_backward))
    return args, kwargs


def after_forward(module: nn.Module, args, output):
    """Shards back on the modules; FULL_SHARD (and any forward without grad) frees the full ones."""
    (unit := unit_of(module)).restore_shards()
    recompute.before_backward(unit, output)  # before the scope closes: it tells whether the unit's hooks saw a save
    if unit.saved_scope is not None:
        unit.saved_scope.close()
        unit.saved_scope = None
    if unit.frees_after_forward or not torch.is_grad_enabled():
        unit.reshard()
    buffers.after_forward(unit)
    return output
