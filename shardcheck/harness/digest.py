"""A value named by its content in 16 bytes: ranks compare values by exchanging digests.

Two values with equal digests are identical: tensors bit for bit (so two NaNs of the same payload
agree, and 0.0 and -0.0 do not), everything else by a representation that cannot tell two
different values apart. A value with anything else inside has no digest (None), and the caller
must compare the values themselves.
"""

from __future__ import annotations

import ctypes
import hashlib
from typing import Any

import torch

SIZE = 16
_BY_REPR = (str, bytes, int, float, bool, type(None), torch.dtype, torch.device)


def digest(value: Any) -> bytes | None:
    """`SIZE` bytes naming `value`, or None if something in it has no faithful representation here.

    Tensors count by dtype, shape and bytes (any layout or device); strings, bytes, numbers, None,
    dtypes and devices by ``repr``; lists, tuples and dicts by their type and items, in order.
    Anything else is None: its ``repr`` may not tell two values apart (an object's holds its
    address; a large numpy array's is abbreviated)."""
    h = hashlib.blake2b(digest_size=SIZE)
    return h.digest() if _feed(h, value) else None


def _feed(h, value: Any) -> bool:
    if torch.is_tensor(value):
        t = value.detach().cpu()
        if type(t) is not torch.Tensor or t.layout != torch.strided:  # a subclass, sparse: no bytes
            return False
        t = t.contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()) if t.numel() else b"")  # no numpy
        return True
    if type(value) is dict:
        h.update(f"D{len(value)}".encode())
        return all(_feed(h, k) and _feed(h, v) for k, v in value.items())
    if type(value) in (list, tuple):
        h.update(f"{type(value).__name__[0]}{len(value)}".encode())
        return all(_feed(h, v) for v in value)
    if type(value) in _BY_REPR:
        h.update(f"{type(value).__name__}:{value!r};".encode())
        return True
    return False
