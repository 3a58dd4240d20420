"""A mixture of experts whose experts get no tokens on some ranks (issue 60, the loop's knobs:
test_training_loop_knobs_experts.py; capability `idle_experts`, Recipe.routed).

`RoutedNet` is ``head(h + moe(h))`` with ``h = tanh(embed(x))``; `moe` is a router (a Linear giving
softmax gates over EXPERTS experts) and one nn.Module per expert (two Linears and a tanh), top-1:
each token goes through its one expert, scaled by its gate, so the router learns too. An expert no
token of the batch is routed to is not called, as a loop over experts that skips an empty one does
(transformers' Mixtral and Qwen2-MoE blocks before version 5): it has no gradient on that rank.

The suite's own module, said plainly: transformers 5 fuses a MoE layer's experts into 3-D parameters
(one parameter for all experts, every one of them called with zero tokens or more), so an expert
that gets no token is no parameter of its own there. And the routing is the batch's, not the
router's argmax: each token carries the expert it goes to (hash routing, as in Roller et al.'s Hash
Layers), so that which expert is idle on which rank in which step is chosen by the schedule below
and stays so however the router's weights move. The gates are still the router's.

The schedules (`ROUTES`; rank r of W, step s, E = EXPERTS):

    idle_on_a_rank   rank r routes its tokens to every expert but (s + r) % E: each expert is idle on
                     some rank (on rank 0 and on no other at world size 2, step 0: expert 0) and used
                     on another, so its gradient is the other ranks' contribution / W on every rank
    idle_everywhere  step 0: every rank routes to every expert; from step 1 no rank routes to expert
                     E - 1: its gradient is None (unsharded data-parallel training: no rank has one),
                     and AdamW must skip it; a zero gradient would decay it and step it by its moments
    every_expert     every rank routes to every expert (the experts on a mesh of their own: `expert_mesh`)
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPERTS, WIDTH, TOKENS = 4, 4, 6
UNITS = ("moe",)  # the block holding router and experts is a unit, as recipes wrap per decoder layer
EXPERT_UNIT = "moe.experts"  # the experts' unit on a mesh of their own (ShardSpec.unit_meshes)
ROUTED = tuple(f"moe.experts.mlps.{e}.{layer}.{kind}" for e in range(EXPERTS) for layer in (0, 2)
               for kind in ("weight", "bias"))


class Experts(nn.Module):
    """The experts, one module each (`mlps`), called on the tokens routed to them, scaled by their gates."""

    def __init__(self) -> None:
        super().__init__()
        self.mlps = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, 6), nn.Tanh(), nn.Linear(6, WIDTH))
                                  for _ in range(EXPERTS))

    def forward(self, h: torch.Tensor, route: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(h)
        for e, mlp in enumerate(self.mlps):
            rows = (route == e).nonzero().view(-1)
            if rows.numel() == 0:
                continue  # no token for this expert here: not called, no gradient on this rank
            out = out.index_add(0, rows, gates[rows, e:e + 1] * mlp(h[rows]))
        return out


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(WIDTH, EXPERTS)
        self.experts = Experts()

    def forward(self, h: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        return self.experts(h, route, torch.softmax(self.router(h), dim=-1))


class RoutedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(WIDTH, WIDTH)
        self.moe = MoE()
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, batch) -> torch.Tensor:
        x, route = batch
        h = torch.tanh(self.embed(x))
        return self.head(h + self.moe(h, route))


def loss_fn(model, batch) -> torch.Tensor:
    x, route, y = batch
    return F.mse_loss(model((x, route)).float(), y)


def experts_used(schedule: str, rank: int, step: int) -> list[int]:
    """The experts rank `rank`'s tokens go to at `step` (module doc)."""
    if schedule == "idle_on_a_rank":
        return [e for e in range(EXPERTS) if e != (step + rank) % EXPERTS]
    if schedule == "idle_everywhere":
        return list(range(EXPERTS if step == 0 else EXPERTS - 1))
    if schedule == "every_expert":
        return list(range(EXPERTS))
    raise ValueError(f"unknown routing schedule {schedule!r}; one of {', '.join(ROUTES)}")


ROUTES = ("idle_on_a_rank", "idle_everywhere")


def batches(ctx, schedule: str, steps: int) -> list:
    """This rank's (x, route, y) of each step: TOKENS tokens spread over the experts the schedule uses."""
    out = []
    for step in range(steps):
        used = experts_used(schedule, ctx.rank, step)
        route = torch.tensor([used[i % len(used)] for i in range(TOKENS)])
        with ctx.seeded(1000 * step + ctx.rank):
            x, y = torch.randn(TOKENS, WIDTH), torch.randn(TOKENS, 1)
        out.append((x.to(ctx.device), route.to(ctx.device), y.to(ctx.device)))
    return out
