"""The workloads of the behaviour checks: a model, a loss, and every rank's batches.

Each workload is plain torch (no sharding): `build()` makes the model on the CPU (the check seeds
and moves it), `loss_fn(model, batch)` is this rank's mean loss, `batches(ctx, steps)` differ per
rank and per step. `units` are the sub-modules to shard as their own units (engines without units
ignore them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardcheck.conformance.checks.support.models import NestedWrappedModule, unit_paths


class UnevenMLP(nn.Module):
    """Linear(7, 5) -> ReLU -> Linear(5, 3) -> ReLU -> Linear(3, 1). No row count divides 2 or 4, and
    the head (one row, one bias element) leaves 1 rank of 2 and 3 ranks of 4 with EMPTY shards.

    `poison` (a scalar, 0 normally) adds `poison * head.bias` to the loss through a separate term:
    only the head bias's gradient becomes `poison` (inf or NaN), on this rank only."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(7, 5), nn.ReLU(), nn.Linear(5, 3), nn.ReLU())
        self.head = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor, poison: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.head(self.body(x)), (poison * self.head.bias).sum()


def _mlp_loss(model, batch) -> torch.Tensor:
    x, y, poison = batch
    out, extra = model(x, poison)
    return F.mse_loss(out.float(), y) + extra.float()


def _mlp_batches(ctx, steps: int, poison: dict[int, float] | None = None) -> list:
    """Per-rank (x, y, poison); `poison` maps a step to the value rank 1 (or 0 at world size 1) uses."""
    out = []
    for step in range(steps):
        with ctx.seeded(1000 * step + ctx.rank):
            x, y = torch.randn(6, 7, device=ctx.device), torch.randn(6, 1, device=ctx.device)
        p = (poison or {}).get(step, 0.0) if ctx.rank == min(1, ctx.world_size - 1) else 0.0
        out.append((x, y, torch.tensor(p, device=ctx.device)))
    return out


def _nested_loss(model, batch) -> torch.Tensor:
    (x,) = batch
    return model(x).float().sum()  # the seeds' loss (seed 001, 003)


def _nested_batches(ctx, steps: int, poison=None) -> list:
    assert not poison, "NestedWrappedModule has no poison input"
    out = []
    for step in range(steps):
        with ctx.seeded(1000 * step + ctx.rank):
            out.append((torch.rand(4, 8, device=ctx.device),))
    return out


@dataclass(frozen=True)
class Workload:
    build: Callable[[], nn.Module]
    loss_fn: Callable
    batches: Callable
    units: tuple[str, ...]


WORKLOADS = {
    "uneven_mlp": Workload(UnevenMLP, _mlp_loss, _mlp_batches, ("body",)),
    "nested": Workload(lambda: NestedWrappedModule(), _nested_loss, _nested_batches,
                       unit_paths(NestedWrappedModule())),
}
