"""Bytes of tensor storage a rank holds, measured at the allocations, whatever engine made them.

`MemoryTracker` is a `TorchDispatchMode`: every op's outputs pass through it, so it sees every
storage an engine allocates on this rank while it is active (parameters, gradients, optimizer
state, all-gather buffers, autograd's saved activations), including those only C++ refers to. A
storage is counted from the op that created it until it is freed (a weak reference's callback)
or resized (FSDP frees a gathered parameter with `UntypedStorage.resize_(0)`, which no op
dispatches: the method is wrapped while a tracker is active). Storages that existed before the
tracker are never counted, so a measurement holds what was built under it and nothing else; nor are
the few bytes of tensors made from Python data (`torch.tensor(0.0)`, Adam's step counter), which pass
no dispatcher op.

    live   = sum of the counted storages' current sizes
    peak   = max of live since the last `mark()`

A backend's worker thread may let go of a collective's buffers a moment after the collective
returned: `settled()` reads `live` once it has stopped moving.

Gathered parameters are told apart by where their bytes came from, not by what an engine calls
them: the output of an all-gather (any c10d or functional all-gather op) is *gathered*, and so is
whatever a copy op fills from gathered bytes (FSDP2 copies its all-gather buffer out into the
unsharded parameters, a cast makes the compute-dtype copy). A gathered storage stays gathered until
it is freed or resized; its bytes are counted at every moment:

    gathered        = sum of the gathered storages' current sizes
    gathered_peak   = max of gathered since the last `mark()` (or `mark_gathered()`)
    gathered_since(e) = the gathered bytes alive now that were gathered at or after epoch e

Thread-local like every dispatch mode: a rank thread (threaded backend) has its own. `kinds()`
splits the live bytes by what Python can see holding them: optimizer state (`Optimizer.state` of
every optimizer), gradients (`.grad` of leaf tensors), parameters (`nn.Parameter`), and other
(buffers, engine-owned flat buffers, saved tensors).
"""

from __future__ import annotations

import gc
import threading
import time
import weakref
from functools import partial

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import (TorchDispatchMode, is_traceable_wrapper_subclass,
                                         is_traceable_wrapper_subclass_type)
from torch.utils._pytree import tree_leaves

KINDS = ("parameters", "gradients", "optimizer", "other")
GATHERS = ("all_gather", "allgather", "_allgather", "all_gather_into_tensor")  # op name prefixes
COPIES = frozenset({  # ops whose outputs hold their inputs' values: gathered in, gathered out
    "copy_", "_to_copy", "clone", "cat", "constant_pad_nd", "split_with_sizes_copy", "narrow_copy",
    "slice_copy", "view_copy", "_foreach_copy_", "chunk_cat", "index_select"})

_ACTIVE: set = set()  # trackers entered, in any thread: each hears of every storage resize
_LOCK = threading.Lock()
_ORIGINAL_RESIZE = torch.UntypedStorage.resize_


def _resize_heard(storage: torch.UntypedStorage, size: int):
    out = _ORIGINAL_RESIZE(storage, size)
    for tracker in list(_ACTIVE):
        tracker.resized(storage)
    return out


def plain_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors that own storage behind `t`: itself, or a wrapper subclass's (DTensor, NF4) inner
    tensors, recursively."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        return [p for n in names if isinstance(inner := getattr(t, n), torch.Tensor) for p in plain_tensors(inner)]
    return [t]


def storage_key(t: torch.Tensor) -> int:
    """The identity of `t`'s storage (its StorageImpl) while it is alive."""
    return t.untyped_storage()._cdata


def _grad(t: torch.Tensor) -> torch.Tensor | None:
    """A leaf's `.grad`; None for anything else, or for a view autograd refuses to look at (a
    multi-output view modified in place, as FSDP1's flat-parameter views are)."""
    try:
        return t.grad if t.is_leaf and t.requires_grad else None
    except RuntimeError:
        return None


class MemoryTracker(TorchDispatchMode):
    """Live and peak bytes of the storages created on `device` while active (see the module doc)."""

    forwards_every_op = True  # runs each op it sees: a collective counter opened under it listens below it

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device_type = torch.device(device).type
        self.sizes: dict[int, int] = {}   # storage key -> bytes now
        self._refs: dict[int, weakref.ref] = {}
        self.live = 0
        self.peak = 0
        self.epoch = 0                     # advanced by mark(): when a storage was born or gathered
        self.born: dict[int, int] = {}     # storage key -> epoch it was first counted
        self.gathered: dict[int, int] = {}  # storage key -> epoch it last received gathered bytes
        self.gathered_live = 0
        self.gathered_peak = 0

    # -- bookkeeping --------------------------------------------------------------------------
    def _set(self, key: int, nbytes: int) -> None:
        delta = nbytes - self.sizes.get(key, 0)
        self.live += delta
        self.sizes[key] = nbytes
        self.peak = max(self.peak, self.live)
        if key in self.gathered:
            self._gathered_by(delta)

    def _gathered_by(self, delta: int) -> None:
        self.gathered_live += delta
        self.gathered_peak = max(self.gathered_peak, self.gathered_live)

    def _freed(self, key: int, _ref) -> None:
        nbytes = self.sizes.pop(key, 0)
        self.live -= nbytes
        self._refs.pop(key, None)
        self.born.pop(key, None)
        if self.gathered.pop(key, None) is not None:
            self.gathered_live -= nbytes

    def _gather_into(self, t: torch.Tensor) -> None:
        """Mark the counted storages behind `t` as holding gathered bytes, from this epoch."""
        for plain in plain_tensors(t):
            key = storage_key(plain)
            if key in self.sizes:
                if key not in self.gathered:
                    self._gathered_by(self.sizes[key])
                self.gathered[key] = self.epoch

    def resized(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        if key in self.sizes:
            self._set(key, storage.nbytes())

    def track(self, t: torch.Tensor, existing: set[int] = frozenset()) -> None:
        """Count `t`'s storage from now on, unless it is one of `existing` (an op's inputs: a view or
        an in-place result is not an allocation) or already counted (then its size is re-read)."""
        for plain in plain_tensors(t):
            if plain.device.type != self.device_type or isinstance(plain, FakeTensor):
                continue
            storage = plain.untyped_storage()
            key = storage._cdata
            if key in self.sizes:
                self._set(key, storage.nbytes())
            elif key not in existing:
                self._set(key, storage.nbytes())
                self._refs[key] = weakref.ref(storage, partial(self._freed, key))
                self.born[key] = self.epoch

    def settled(self, quiet_s: float = 0.002, limit_s: float = 0.1) -> int:
        """The live bytes once no storage has been freed for `quiet_s` (at most `limit_s`): a backend's
        worker thread lets go of a collective's buffers just after the collective returns."""
        end = time.monotonic() + limit_s
        seen = self.live
        while time.monotonic() < end:
            time.sleep(quiet_s)
            if self.live == seen:
                break
            seen = self.live
        return seen

    def mark(self) -> int:
        """Start a new epoch: restart both peaks at the current live bytes; return them."""
        self.epoch += 1
        self.peak = self.live
        self.mark_gathered()
        return self.live

    def mark_gathered(self) -> None:
        """Restart the gathered peak at the gathered bytes alive now (e.g. between forward and backward)."""
        self.gathered_peak = self.gathered_live

    def gathered_since(self, epoch: int) -> int:
        """Gathered bytes alive now that were gathered at or after `epoch` (not those kept from before)."""
        return sum(self.sizes.get(k, 0) for k, e in self.gathered.items() if e >= epoch)

    # -- the mode -----------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented  # a wrapper subclass dispatches first; its inner ops come back here
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.is_view:  # its outputs alias an input's storage: nothing is born, no size changes
            return out  # (FSDP2 cuts each parameter into world-size views: 16,384 per call at scale)
        if (not func._schema.is_mutable and type(out) is torch.Tensor  # a new tensor, no input resized
                and out.untyped_storage().nbytes() == 0):
            return out  # empty (FSDP2's padding shards past the last row): no bytes to count
        inputs = {storage_key(t) for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) and t.device.type == self.device_type
                  and not is_traceable_wrapper_subclass(t) and not isinstance(t, FakeTensor)}
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        for t in outputs:
            self.track(t, inputs)
        if self._gathers(func, inputs):
            if func.namespace == "c10d":  # in place: the output tensors are the first operand
                outputs += [t for t in tree_leaves(args[:1]) if isinstance(t, torch.Tensor)]
            for t in outputs:
                if t.device.type == self.device_type and not isinstance(t, FakeTensor):
                    self._gather_into(t)
        return out

    def _gathers(self, func, inputs: set[int]) -> bool:
        """Whether `func`'s outputs hold gathered bytes: an all-gather, or a copy of gathered bytes."""
        name = func._schema.name.split("::")[-1]
        if func.namespace in ("c10d", "_c10d_functional"):
            return name.startswith(GATHERS)
        return name in COPIES and any(k in self.gathered and self.sizes.get(k) for k in inputs)

    def __enter__(self):
        with _LOCK:
            if not _ACTIVE:
                torch.UntypedStorage.resize_ = _resize_heard
            _ACTIVE.add(self)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            with _LOCK:
                _ACTIVE.discard(self)
                if not _ACTIVE:
                    torch.UntypedStorage.resize_ = _ORIGINAL_RESIZE

    # -- what holds the bytes -----------------------------------------------------------------
    def kinds(self, born_since: int = 0, without_gathered: bool = False,
              claims: dict[int, str] | None = None) -> dict[str, int]:
        """{kind: live bytes} over KINDS (see the module doc); a storage is counted once, under the
        first of optimizer, gradients, parameters that holds it. Only storages born at or after
        epoch `born_since`, and, with `without_gathered`, none holding gathered bytes. `claims`:
        what `claims()` gave, to split the same moment twice with one walk of the heap."""
        kind_of = self.claims() if claims is None else claims
        out = dict.fromkeys(KINDS, 0)
        for key, nbytes in self.sizes.items():
            if self.born.get(key, 0) >= born_since and not (without_gathered and key in self.gathered):
                out[kind_of.get(key, "other")] += nbytes
        return out

    def claims(self) -> dict[int, str]:
        """{storage key: kind} of the storages Python names as optimizer state, gradients or parameters
        (a walk of every object the garbage collector tracks)."""
        kind_of: dict[int, str] = {}

        def claim(kind, tensors):
            for t in tensors:
                if isinstance(t, torch.Tensor):
                    for plain in plain_tensors(t):
                        if plain.device.type == self.device_type:
                            kind_of.setdefault(storage_key(plain), kind)

        optimizers, tensors = [], []
        for obj in gc.get_objects():  # type(), not isinstance: some module objects warn on __class__
            if issubclass(type(obj), torch.Tensor):
                tensors.append(obj)
            elif issubclass(type(obj), torch.optim.Optimizer):
                optimizers.append(obj)
        for optimizer in optimizers:
            claim("optimizer", [v for state in optimizer.state.values() for v in state.values()])
        claim("gradients", [_grad(t) for t in tensors])
        claim("parameters", [t for t in tensors if issubclass(type(t), nn.Parameter)])
        return kind_of
