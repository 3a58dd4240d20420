"""What the traffic reproductions share: `counting()` records every c10d collective this rank issues
(torch's dispatcher sees them all, whichever engine calls), as {kind: [calls, bytes of the full buffer]}."""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass_type
from torch.utils._pytree import tree_leaves


class counting(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = defaultdict(lambda: [0, 0])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        if func.namespace in ("c10d", "_c10d_functional") and "wait" not in func.__name__ \
                and "barrier" not in func.__name__:
            size = max(sum(t.numel() * t.element_size() for t in tree_leaves(a) if isinstance(t, torch.Tensor))
                       for a in (*args, out))
            kind = func._schema.name.split("::")[-1].strip("_").split("_base")[0].split("_into")[0]
            self.seen[kind][0] += 1
            self.seen[kind][1] += size
        return out

    def table(self) -> str:
        return ", ".join(f"{k} {n} calls {b} bytes" for k, (n, b) in sorted(self.seen.items()))
