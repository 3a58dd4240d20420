"""Every collective op this process dispatches, heard at no cost to the other ops.

A ``TorchDispatchMode`` sees every op: each one then costs a Python call (a two-layer seed
transformer's forward and backward takes 3.4 times the CPU under one), and a training step is
thousands of ops for a few dozen collectives. While a listener is open (`listening`), this module
instead registers a Python kernel at the ``BackendSelect`` dispatch key of every op in the
namespaces ``c10d`` (what ``dist.all_reduce`` and friends, and engines' C++ such as DDP's reducer,
dispatch to) and ``_c10d_functional`` (DTensor, compiled code). The kernel runs the op on (a
redispatch to the keys below ``BackendSelect``), then hands each listener the op, its arguments and
its result. No other op passes through Python.

What a listener hears is what a dispatch mode at the top of the stack heard:

* below every tensor subclass: a wrapper subclass (DTensor) dispatches first, and the collectives it
  issues on its local tensors come back here as plain tensors;
* the outermost collective only: one issued inside another's kernel (a functional collective runs
  c10d's) is not heard again;
* not a fake tensor's kernel run (``torch.compile`` tracing a collective on meta: the meta key in
  thread-local state), which issues nothing;
* in ``no_grad`` and ``inference_mode`` alike (``BackendSelect`` is never excluded), and from every
  thread of the process: an autograd worker thread's reductions (CUDA) are this process's too.

A dispatch mode that answers a collective without dispatching it further (simulate's
``SilentCollectives``) hides it from this kernel: `modes_may_answer_collectives` tells a caller to go
as a mode on top of such a stack instead (``traffic.CollectiveCounter`` does). A mode that runs every
op it sees (the memory tracker) says so with a class attribute ``forwards_every_op = True``.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

NAMESPACES = ("c10d", "_c10d_functional")
Listener = Callable[[Any, tuple, Any], None]  # (OpOverload, args, result)

_LOCK = threading.Lock()
_LISTENERS: list[Listener] = []
_LIBRARIES: list[torch.library.Library] = []
_INSIDE = threading.local()  # .depth > 0 while a collective's kernel runs on this thread
_BELOW = torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.BackendSelect)


def modes_may_answer_collectives() -> bool:
    """A ``TorchDispatchMode`` on this thread's stack (each sees an op before this module's kernel)
    may answer a collective without running it: one that does not declare ``forwards_every_op``."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return any(not getattr(mode, "forwards_every_op", False) for mode in _get_current_dispatch_mode_stack())


def _first_tensor(args: tuple, kwargs: dict) -> torch.Tensor:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value
        for leaf in tree_leaves(value):
            if isinstance(leaf, torch.Tensor):
                return leaf
    raise TypeError("a collective op without a tensor operand")


def _kernel(op) -> Callable:
    def kernel(*args, **kwargs):
        keys = torch._C._dispatch_keys(_first_tensor(args, kwargs)) & _BELOW
        depth = getattr(_INSIDE, "depth", 0)
        _INSIDE.depth = depth + 1
        try:
            out = op.redispatch(keys, *args, **kwargs)
        finally:
            _INSIDE.depth = depth
        if depth == 0 and not torch._C._meta_in_tls_dispatch_include():
            for listener in list(_LISTENERS):
                listener(op, args, out)
        return out
    return kernel


@functools.cache
def _ops() -> tuple[tuple[str, str, Callable], ...]:
    """(namespace, "name[.overload]", kernel) for every op of NAMESPACES (all registered by
    libtorch as torch.distributed loads; listing every op name costs 3 ms, so once a process)."""
    out = []
    for qualified in sorted(torch._C._dispatch_get_all_op_names()):
        namespace, _, name = qualified.partition("::")
        if namespace not in NAMESPACES or torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "BackendSelect"):
            continue
        packet = getattr(getattr(torch.ops, namespace), name)
        for overload in packet.overloads():
            full = name if overload == "default" else f"{name}.{overload}"
            out.append((namespace, full, _kernel(getattr(packet, overload))))
    return tuple(out)


def _register() -> None:
    libraries = {namespace: torch.library.Library(namespace, "IMPL") for namespace in NAMESPACES}
    for namespace, name, kernel in _ops():
        libraries[namespace].impl(name, kernel, "BackendSelect")
    _LIBRARIES.extend(libraries.values())


def _unregister() -> None:
    while _LIBRARIES:
        _LIBRARIES.pop()._destroy()


@contextmanager
def listening(listener: Listener) -> Iterator[None]:
    """``listener(op, args, result)`` after each collective op this process dispatches, until the
    block ends; the kernels are registered while any listener is open."""
    with _LOCK:
        if not _LISTENERS:
            _register()
        _LISTENERS.append(listener)
    try:
        yield
    finally:
        with _LOCK:
            _LISTENERS.remove(listener)
            if not _LISTENERS:
                _unregister()
