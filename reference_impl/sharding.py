"""Sharded units: ``shard()`` a module, all-gather before use, reduce-scatter the gradient.

A *unit* is a module passed to :func:`shard` together with the parameters it owns (those not
owned by an already-sharded sub-unit).  The unit replaces each owned parameter, on every module
that holds it, by a new ``nn.Parameter`` holding only this rank's rows (its *local shard*), so
``model.parameters()`` is what the optimizer updates.  Around the unit's forward:

* pre-forward: all-gather the shards (one flat collective) inside :class:`_Unshard`, an autograd
  function, and put the full tensors on the modules in place of the shards;
* post-forward: put the shards back; FULL_SHARD / HYBRID_SHARD also drop the full tensors.  The
  autograd graph then only holds tokens for them (``saved_tensors_hooks``), and the first backward
  use re-gathers the unit once;
* backward of :class:`_Unshard`: reduce-scatter the full gradients into the shard gradients.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn as nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from . import collectives as C
from .extensions import ExtensionParam, has_extension
from .topology import ShardingStrategy, compute_device, groups_of
from .mixed_precision import MixedPrecision, cast_buffers, cast_floating, compute_dtype, grad_dtype, reduce_dtype


@dataclass
class ShardedParam:
    shard: nn.Parameter  # the local shard: registered on the modules, updated by the optimizer
    slot: C.Slot  # unsharded shape and row layout
    uses: list[tuple[nn.Module, str]]  # every (module, attribute) that holds this parameter
    extension: Optional[ExtensionParam] = None  # state of fsdp_pre/post_all_gather, if defined


@dataclass(repr=False)
class Unit:
    """Per-unit state, stored on the module (see :func:`units`)."""

    module: nn.Module
    params: list[ShardedParam]
    strategy: ShardingStrategy
    shard_group: Any  # ranks among which a parameter is split (None: size 1)
    replicate_group: Any  # ranks holding identical shards; gradients are all-reduced over it
    dp_group: Any  # all data-parallel ranks (for clip_grad_norm_)
    mesh: Any
    mp: Optional[MixedPrecision]
    device: torch.device  # where the full parameters live and compute happens
    is_root: bool = True
    comm_hook: Any = None
    comm_hook_state: Any = None
    full: Optional[list[torch.Tensor]] = None  # the unsharded tensors while gathered
    originals: dict = field(default_factory=dict)  # id -> weakref of the replaced unsharded params
    _saved_hooks: Any = None
    _callback_queued: bool = False

    def __repr__(self) -> str:
        return f"Unit({type(self.module).__name__}, {self.strategy.name}, {len(self.params)} params, root={self.is_root})"

    @property
    def shard_rank(self) -> int:
        return C.group_rank(self.shard_group)

    @property
    def shard_size(self) -> int:
        return C.group_size(self.shard_group)

    @property
    def first_replica(self) -> bool:
        """Whether this rank's shards count for norms (each element once across the dp world)."""
        return C.group_rank(self.replicate_group) == 0

    @property
    def frees_after_forward(self) -> bool:
        return self.strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD) and self.shard_size > 1

    # -- all-gather ---------------------------------------------------------------------------
    def all_gather(self, param_dtype: Optional[torch.dtype] = None) -> list[torch.Tensor]:
        """Full tensors of all owned parameters, in ``param_dtype`` (default: the compute dtype).

        Plain parameters travel in one ``all_gather_single`` of the flat padded layout;
        parameters with all-gather extensions go through their hooks one by one.
        """
        fulls: list[Optional[torch.Tensor]] = [None] * len(self.params)
        plain = [i for i, p in enumerate(self.params) if not has_extension(p.shard)]
        if plain:
            dtype = param_dtype or compute_dtype(self.mp, self.params[plain[0]].shard.dtype)
            slots = [self.params[i].slot for i in plain]
            local = C.pack_shards([self.params[i].shard.to(self.device) for i in plain], slots, dtype)
            gathered = C.all_gather_flat(local, self.shard_group)
            for i, full in zip(plain, C.unpack_full(gathered, slots, self.shard_size)):
                fulls[i] = full
        for i, p in enumerate(self.params):
            if fulls[i] is None:
                p.extension = p.extension or ExtensionParam()
                start, end = p.slot.local_rows(self.shard_rank)
                dtype = param_dtype or compute_dtype(self.mp, p.shard.dtype)
                fulls[i] = p.extension.all_gather(
                    p.shard, p.slot, end - start, self.shard_group, self.device, self.mesh, self.module, self.mp or MixedPrecision(), dtype
                )
        return fulls

    def unshard(self, differentiable: bool) -> list[torch.Tensor]:
        self.reshard()
        shards = [p.shard for p in self.params]
        if differentiable and any(s.requires_grad for s in shards):
            self.full = list(_Unshard.apply(self, *shards))
        else:
            with torch.no_grad():
                self.full = self.all_gather()
        return self.full

    def reshard(self) -> None:
        for t in self.full or []:
            _LIVE.pop(_storage_key(t), None)
        self.full = None

    def full_for_backward(self) -> list[torch.Tensor]:
        """Re-gather (once per backward) the full tensors that a token stands for."""
        if self.full is None:
            with torch.no_grad():
                self.full = self.all_gather()
            if not self._callback_queued:  # free them at the latest when backward ends
                self._callback_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        return self.full

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        self.reshard()

    # -- swap full tensors and shards on the modules ------------------------------------------
    def adopt_module_params(self) -> None:
        """Take the shards from the modules again: ``module.to_empty()`` / ``.to()`` may register new
        Parameter objects (and untie shared ones); the first holder's object wins and is re-tied."""
        for p in self.params:
            module, name = p.uses[0]
            current = module._parameters[name]
            if current is not p.shard and isinstance(current, nn.Parameter) and not hasattr(current, "_full_view"):
                p.shard = current
                for m, n in p.uses:
                    m._parameters[n] = current

    def install(self, tensors) -> None:
        for p, t in zip(self.params, tensors):
            for module, name in p.uses:
                module._parameters[name] = t  # plain dict write: may hold a non-leaf tensor

    def restore_shards(self) -> None:
        self.install([p.shard for p in self.params])

    # -- gradients ----------------------------------------------------------------------------
    def communicate(self, flat: torch.Tensor) -> torch.Tensor:
        """Average a ``[shard_size * S]`` gradient buffer over the dp world; returns ``[S]``."""
        if self.comm_hook is None:
            return C.average_gradient(flat, self.shard_group, self.replicate_group)
        if self.strategy is ShardingStrategy.NO_SHARD:  # all-reduce in place: hook(state, grad)
            self.comm_hook(self.comm_hook_state, flat)
            return flat
        out = torch.zeros(flat.numel() // self.shard_size, dtype=flat.dtype, device=flat.device)
        self.comm_hook(self.comm_hook_state, flat, out)  # sharded: hook(state, grad, output)
        return out

    def reduce_grads(self, grads) -> None:
        """Backward of the unshard: full gradients -> averaged shard gradients, accumulated."""
        self.reshard()
        plain = [i for i, p in enumerate(self.params) if p.extension is None and p.shard.requires_grad]
        if any(grads[i] is not None for i in plain):
            rdtype = reduce_dtype(self.mp, self.params[plain[0]].shard.dtype)
            slots = [self.params[i].slot for i in plain]
            flat = C.pack_full([grads[i] for i in plain], slots, self.shard_size, rdtype, self.device)
            shard_grads = C.unpack_shards(self.communicate(flat), slots, self.shard_rank)
            for i, g in zip(plain, shard_grads):
                if grads[i] is not None:
                    _accumulate(self.params[i].shard, g, grad_dtype(self.mp, self.params[i].shard.dtype))
        for p, g in zip(self.params, grads):
            if p.extension is not None and p.shard.requires_grad and g is not None:
                _accumulate(p.shard, self._reduce_one(g, p), grad_dtype(self.mp, p.shard.dtype))

    def _reduce_one(self, g: torch.Tensor, p: ShardedParam) -> torch.Tensor:
        """Reduce one full gradient; a wrapper subclass (e.g. TwoTensor) inner tensor by inner tensor."""
        start, end = p.slot.local_rows(self.shard_rank)
        shape = torch.Size([end - start, *p.slot.shape[1:]])
        if is_traceable_wrapper_subclass(g):
            names, ctx = g.__tensor_flatten__()
            inner = {n: self._reduce_one(getattr(g, n), p) for n in names}
            return type(g).__tensor_unflatten__(inner, ctx, shape, torch.empty(shape, device="meta").stride())
        flat = C.pack_full([g], [p.slot], self.shard_size, reduce_dtype(self.mp, g.dtype), self.device)
        return C.unpack_shards(self.communicate(flat), [p.slot], self.shard_rank)[0]


def _accumulate(param: nn.Parameter, grad: torch.Tensor, dtype: torch.dtype) -> None:
    grad = grad.to(device=param.device, dtype=dtype)
    if param.grad is None:
        param.grad = grad
    else:
        param.grad += grad


class _Unshard(torch.autograd.Function):
    """``forward``: shards -> full tensors (all-gather).  ``backward``: full grads -> shard grads
    (reduce-scatter / all-reduce, averaged), written into ``shard.grad`` directly so that
    low-precision and CPU-offloaded gradients keep their dtype and device."""

    @staticmethod
    def forward(ctx, unit: Unit, *shards):
        ctx.unit = unit
        ctx.set_materialize_grads(False)
        fulls = unit.all_gather()
        ctx.mark_non_differentiable(*[f for f, s in zip(fulls, shards) if not s.requires_grad])
        return tuple(fulls)

    @staticmethod
    def backward(ctx, *grads):
        ctx.unit.reduce_grads(grads)
        return (None,) * (1 + len(grads))


# -- FULL_SHARD: keep tokens, not full tensors, in the autograd graph -------------------------
_LIVE: dict[int, tuple[Unit, int]] = {}  # storage pointer of a gathered full tensor -> owner


def _storage_key(t: torch.Tensor) -> Optional[int]:
    if type(t) not in (torch.Tensor, nn.Parameter) or t.layout != torch.strided or t.numel() == 0 or t.is_meta:
        return None
    return t.untyped_storage().data_ptr()


@dataclass(frozen=True)
class _Token:
    unit: Unit
    index: int
    size: torch.Size
    stride: tuple
    offset: int


def _pack(t: torch.Tensor):
    owner = _LIVE.get(_storage_key(t))
    if owner is None:
        return t
    return _Token(owner[0], owner[1], t.size(), t.stride(), t.storage_offset())


def _unpack(x):
    if isinstance(x, _Token):
        return x.unit.full_for_backward()[x.index].as_strided(x.size, x.stride, x.offset)
    return x


# -- forward hooks ----------------------------------------------------------------------------
def _pre_forward(module: nn.Module, args, kwargs):
    unit = unit_of(module)
    unit.adopt_module_params()
    if unit.mp is not None:
        args, kwargs = cast_floating((args, kwargs), unit.mp.param_dtype)
    grad = torch.is_grad_enabled()
    fulls = unit.unshard(differentiable=grad)
    unit.install(fulls)
    if grad and unit.frees_after_forward:
        for i, t in enumerate(fulls):
            key = _storage_key(t)
            if key is not None:
                _LIVE[key] = (unit, i)
        unit._saved_hooks = torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)
        unit._saved_hooks.__enter__()
    return args, kwargs


def _post_forward(module: nn.Module, args, output):
    unit = unit_of(module)
    unit.restore_shards()
    if unit._saved_hooks is not None:
        unit._saved_hooks.__exit__(None, None, None)
        unit._saved_hooks = None
    if unit.frees_after_forward or not torch.is_grad_enabled():
        unit.reshard()
    return output


# -- public -----------------------------------------------------------------------------------
def unit_of(module: nn.Module) -> Optional[Unit]:
    return module.__dict__.get("_sharded_unit")


def units(module: nn.Module, adopt: bool = True) -> list[Unit]:
    """All units in ``module``'s tree, root first (module order).  Outside forward, ``adopt``
    first re-reads the shards from the modules (see :meth:`Unit.adopt_module_params`)."""
    found = [u for m in module.modules() if (u := unit_of(m)) is not None]
    if adopt:
        for u in found:
            u.adopt_module_params()
    return found


def local_shard(param: nn.Parameter) -> nn.Parameter:
    """The tensor that is all-gathered from: the registered sharded parameter itself.

    Monkey-patch ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` on this object (after
    ``to_empty()``, which may replace tensor contents)."""
    return param


def _owned_modules(module: nn.Module):
    """``module`` and its descendants, not descending into already-sharded sub-units."""
    yield module
    for child in module.children():
        if unit_of(child) is None:
            yield from _owned_modules(child)


def _was_replaced_by(unit: Unit, p: nn.Parameter) -> bool:
    ref = unit.originals.get(id(p))
    return ref is not None and ref() is p


def shard(
    module: nn.Module,
    *,
    mesh=None,
    process_group=None,
    strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD,
    mixed_precision: Optional[MixedPrecision] = None,
    offload: bool = False,
) -> nn.Module:
    """Make ``module`` a sharded unit (in place; returns it).  Shard sub-modules first, root last.

    ``offload=True`` keeps shards and their gradients on the CPU and copies shards to the compute
    device (``mesh.device_type``) for each all-gather.
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
        with torch.no_grad():
            local = C.shard_rows(orig.detach(), slot, srank).clone()
        if offload and not local.is_meta:
            local = local.cpu()
        elif not local.is_meta:
            local = local.to(device)
        p = nn.Parameter(local, requires_grad=orig.requires_grad)
        gd = grad_dtype(mixed_precision, p.dtype)
        if gd != p.dtype:
            p.grad_dtype = gd  # keep_low_precision_grads: allow a grad dtype other than the param's
        params.append(ShardedParam(p, slot, where))
    plain_dtypes = {sp.shard.dtype for sp in params if not is_traceable_wrapper_subclass(sp.shard)}
    if len(plain_dtypes) > 1:
        raise ValueError(f"a unit's parameters must share one dtype, got {plain_dtypes}")
    unit = Unit(module, params, strategy, shard_group, replicate_group, dp_group, mesh, mixed_precision, device)
    unit.originals = {id(orig): weakref.ref(orig) for orig in uses}
    unit.restore_shards()
    for m in owned:
        cast_buffers(m, mixed_precision)
    for u in sub_units:
        u.is_root = False
    module.__dict__["_sharded_unit"] = unit
    module.register_forward_pre_hook(_pre_forward, with_kwargs=True)
    module.register_forward_hook(_post_forward)
    return module
