"""What sharding *should* give, computed from the unsharded shapes alone (no implementation code).

``torch.chunk(p, ws)`` along dim 0: with ``n`` rows, ``c = ceil(n / ws)`` rows per rank; rank ``r``
holds ``max(0, min(c, n - r*c))`` rows (trailing ranks fewer, or none) and pads to ``c``.  A 0-d
parameter counts as one row of one element.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

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


# -- the 2-D (replicate, shard) mesh -------------------------------------------------------------
@dataclass(frozen=True)
class Mesh:
    """``replicate x shard`` ranks, row-major like ``init_device_mesh((R, S))``: rank ``r`` is replica
    ``r // S``, shard rank ``r % S``.  Parameters are split over the ``S`` ranks of a shard group
    (``r // S * S .. + S - 1``) and replicated over the ``R`` ranks of a replicate group
    (``r % S``, step ``S``).  ``two_d=False`` is the 1-D world (``R = 1``, FULL_SHARD)."""

    replicate: int
    shard: int
    two_d: bool = True

    @property
    def world_size(self) -> int:
        return self.replicate * self.shard

    @property
    def shape(self) -> list[int]:
        return [self.replicate, self.shard] if self.two_d else [self.shard]

    def coords(self, rank: int) -> tuple[int, int]:
        return divmod(rank, self.shard)

    def shard_group(self, rank: int) -> str:
        return progression(rank // self.shard * self.shard, 1, self.shard)

    def replicate_group(self, rank: int) -> str:
        return progression(rank % self.shard, self.shard, self.replicate)

    @staticmethod
    def parse(text: str | None, world_size: int) -> "Mesh":
        """``None`` -> 1-D of ``world_size``; ``"RxS"`` -> 2-D, and ``R * S`` must be the world size."""
        if text is None:
            return Mesh(1, world_size, two_d=False)
        try:
            r, s = (int(x) for x in text.lower().split("x"))
        except ValueError:
            raise ValueError(f"mesh must be REPLICATExSHARD, e.g. 128x128, got {text!r}") from None
        if r < 1 or s < 1 or r * s != world_size:
            raise ValueError(f"mesh {r}x{s} has {r * s} ranks, not the world size {world_size}")
        return Mesh(r, s)


def progression(start: int, step: int, count: int) -> str:
    """A set of ranks ``start, start + step, ...`` (``count`` of them), written canonically."""
    return str(start) if count == 1 else f"{start}..{start + (count - 1) * step} step {step}"


def describe_ranks(ranks) -> str:
    """:func:`progression`'s spelling of a measured group's ranks, or the list when irregular."""
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return str(ranks[0])
    step = ranks[1] - ranks[0]
    if step > 0 and all(b - a == step for a, b in zip(ranks, ranks[1:])):
        return progression(ranks[0], step, len(ranks))
    return "ranks " + ",".join(map(str, ranks[:8])) + (",..." if len(ranks) > 8 else "")


# -- which ranks are alike -----------------------------------------------------------------------
def rank_classes(layouts, shard: int) -> list[tuple[int, int]]:
    """Maximal intervals ``[a, b)`` of shard ranks that hold the same rows of every parameter.

    For ``n`` rows and ``c = ceil(n / S)``, shard rank ``s`` holds ``c`` rows for ``s < n // c``,
    ``n mod c`` at ``s = n // c`` and none after: a parameter changes only at ``n // c`` and
    ``n // c + 1``, so a few cuts (not ``S`` ranks x parameters) give every class."""
    cuts = {0, shard}
    for p in layouts:
        n, c = p["rows"], p["chunk"]
        if c:
            full = n // c
            cuts.update({min(full, shard), min(full + (1 if n % c else 0), shard)})
    cuts = sorted(cuts)
    return list(zip(cuts, cuts[1:]))


def representative_ranks(classes, mesh: Mesh) -> list[int]:
    """Both ends of every class, in the first and the last replica: off-by-one at a class boundary
    or a dependence on the replica shows up; the ranks in between are alike by construction."""
    ends = {s for a, b in classes for s in (a, b - 1)}
    return sorted(rep * mesh.shard + s for rep in {0, mesh.replicate - 1} for s in ends)


def unit_shard_bytes(unit: list[dict]) -> int:
    """``S_u``: bytes one rank contributes to its unit's flat buffer (every slice padded to ``c``)."""
    return sum(p["chunk"] * p["row_numel"] * p["itemsize"] for p in unit)


def step_collectives(units: list[list[dict]], mesh: Mesh, rank: int, gathers_per_unit: int,
                     empty_units: bool = False) -> dict:
    """Collectives of one step for a per-unit flat-buffer design on ``mesh``, seen from ``rank``:
    ``gathers_per_unit`` all-gathers of ``S * S_u`` bytes and one reduce-scatter of ``S * S_u``
    per unit, in the shard group; with ``R > 1`` one all-reduce of the ``S_u``-byte reduced shard
    per unit, in the replicate group.  ``empty_units``: units without parameters communicate too."""
    sizes = [unit_shard_bytes(u) for u in units if u or empty_units]
    out = {}
    if mesh.shard > 1:
        group = mesh.shard_group(rank)
        out["all_gather"] = {"count": gathers_per_unit * len(sizes),
                             "bytes": gathers_per_unit * mesh.shard * sum(sizes), "groups": [group]}
        out["reduce_scatter"] = {"count": len(sizes), "bytes": mesh.shard * sum(sizes), "groups": [group]}
    if mesh.replicate > 1:
        out["all_reduce"] = {"count": len(sizes), "bytes": sum(sizes), "groups": [mesh.replicate_group(rank)]}
    return dict(sorted(out.items()))
