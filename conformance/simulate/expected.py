"""What sharding *should* give, computed from the unsharded shapes alone (no implementation code).

``torch.chunk(p, ws)`` along dim 0: with ``n`` rows, ``c = ceil(n / ws)`` rows per rank; rank ``r``
holds ``max(0, min(c, n - r*c))`` rows (trailing ranks fewer, or none) and pads to ``c``.  A 0-d
parameter counts as one row of one element.
"""
from __future__ import annotations

import math

import torch.nn as nn


def chunk_rows(rows: int, ws: int) -> int:
    return math.ceil(rows / ws) if rows else 0


def local_rows(rows: int, ws: int, rank: int) -> int:
    c = chunk_rows(rows, ws)
    return max(0, min(c, rows - rank * c))


def param_layout(name: str, shape, itemsize: int, ws: int) -> dict:
    shape = list(shape)
    rows = shape[0] if shape else 1
    row_numel = math.prod(shape[1:]) if shape else 1
    return {"name": name, "shape": shape, "rows": rows, "row_numel": row_numel,
            "chunk": chunk_rows(rows, ws), "itemsize": itemsize}


def units_of(model: nn.Module, ws: int) -> list[list[dict]]:
    """Parameters per unit, in the order units run: each block, then the root's remaining ones."""
    def layouts(module, prefix):
        return [param_layout(prefix + n, p.shape, p.element_size(), ws) for n, p in module.named_parameters()]

    units = [layouts(b, f"blocks.{i}.") for i, b in enumerate(model.blocks)]
    in_blocks = {p["name"] for u in units for p in u}
    units.append([p for p in layouts(model, "") if p["name"] not in in_blocks])
    return units


def expected_row(p: dict, ws: int, rank: int) -> dict:
    """The row of the per-parameter table an exact ``torch.chunk`` sharding produces on ``rank``."""
    held = local_rows(p["rows"], ws, rank)
    local_shape = [held, *p["shape"][1:]] if p["shape"] else [held]
    return {"name": p["name"], "local_shape": local_shape, "padded_rows": p["chunk"] - held,
            "bytes": held * p["row_numel"] * p["itemsize"],
            "bound_bytes": p["chunk"] * p["row_numel"] * p["itemsize"]}
