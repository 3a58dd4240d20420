"""SHARD_OPTIMIZER (ZeRO-1): only the optimizer state is sharded.

The units are NO_SHARD (every rank holds the whole parameters and, after backward, the whole
averaged gradients); ``ShardedOptimizer`` wraps the recipe's torch optimizer so that each rank steps
only its own rows of every parameter, the same rows a sharded unit would keep (``torch.chunk`` along
dim 0: ``collectives.Slot``), and so holds only the optimizer state of those rows: about 1/n of it.

    step:  for every parameter p with a gradient, rank r's optimizer steps the view p[rows of r]
           with the gradient rows g[rows of r] (an element-wise update rule: the same numbers as
           stepping p whole); then each rank's updated rows of every parameter are broadcast from it
           into everyone's p, end to end (one broadcast per rank and dtype), then copied in place:
           the parameters are whole and equal again, P (n-1)/n bytes sent per rank.

The rows are views of the parameters themselves, so stepping them updates p in place and no second
copy of the parameters exists. ``param_groups`` list the whole parameters (what torch's GradScaler
unscales and clipping reads); their hyper-parameters are handed to the inner optimizer at each step.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch
import torch.distributed as dist

from shardcheck.compat import set_grad

from . import collectives as C


class ShardedOptimizer:
    """`build(params) -> torch.optim.Optimizer` applied to this rank's rows of `params`, sharded over
    the process group `group` (the data-parallel ranks)."""

    def __init__(self, params: Iterable[torch.Tensor], build: Callable, group) -> None:
        self.group = group
        self.ws, self.rank = C.group_size(group), C.group_rank(group)
        self.params = list(params)
        self.slots = [C.Slot.of(p.shape, self.ws) for p in self.params]
        # This rank's rows of each parameter: views of its storage (possibly empty: still listed, so
        # that every rank's inner optimizer holds the same entries).
        self.views = [C.shard_rows(p.detach(), slot, self.rank) for p, slot in zip(self.params, self.slots)]
        self.inner = build(self.views)
        whole = dict(zip(map(id, self.views), self.params))
        self.param_groups = [{**g, "params": [whole[id(v)] for v in g["params"]]} for g in self.inner.param_groups]

    def rows_of(self, p: torch.Tensor) -> tuple[int, int]:
        """The rows [start, end) of `p` whose optimizer state this rank holds."""
        return self.slots[self.index(p)].local_rows(self.rank)

    def state_of(self, p: torch.Tensor) -> dict:
        """The optimizer state of this rank's rows of `p` (the inner optimizer's, not copied)."""
        return self.inner.state.get(self.views[self.index(p)], {})

    def set_state(self, p: torch.Tensor, full: dict) -> None:
        """Keep this rank's rows of `full` ({key: full value}) as the optimizer state of `p`: values
        shaped like `p` are cut by rows (moments, momentum buffers), the rest kept (Adam's `step`)."""
        i = self.index(p)
        view, slot = self.views[i], self.slots[i]
        self.inner.state[view] = {k: C.shard_rows(v, slot, self.rank).clone().to(view.device)
                                  if torch.is_tensor(v) and v.shape == p.shape and k != "step" else v
                                  for k, v in full.items()}

    def index(self, p: torch.Tensor) -> int:
        return next(i for i, q in enumerate(self.params) if q is p)

    @torch.no_grad()
    def step(self, closure=None) -> None:
        assert closure is None, "ShardedOptimizer.step takes no closure"
        for mine, inner in zip(self.param_groups, self.inner.param_groups):
            inner.update({k: v for k, v in mine.items() if k != "params"})
        stepped = [i for i, p in enumerate(self.params) if p.grad is not None]
        for i in stepped:
            set_grad(self.views[i], C.shard_rows(self.params[i].grad, self.slots[i], self.rank))  # low-precision too
        self.inner.step()
        for i in stepped:
            self.views[i].grad = None
        rows = {i: self.params[i].detach().reshape(self.slots[i].rows, *self.slots[i].shape[1:]) for i in stepped}
        for owner in range(self.ws):  # every rank's updated rows, from their owner, in place into the parameters
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for i in stepped:
                start, end = self.slots[i].local_rows(owner)
                if end > start:
                    by_dtype.setdefault(rows[i].dtype, []).append(rows[i][start:end])
            for parts in by_dtype.values():
                broadcast_into(parts, dist.get_global_rank(self.group, owner), self.group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()


def broadcast_into(parts: list[torch.Tensor], src: int, group) -> None:
    """`src`'s values of `parts` (views of one dtype) into every rank's, in place: one broadcast of
    them end to end."""
    if dist.get_rank() == src:  # its parts already hold the values
        dist.broadcast(torch.cat([p.reshape(-1) for p in parts]), src=src, group=group)
        return
    flat = torch.empty(sum(p.numel() for p in parts), dtype=parts[0].dtype, device=parts[0].device)
    dist.broadcast(flat, src=src, group=group)
    for part, values in zip(parts, flat.split([p.numel() for p in parts])):
        part.copy_(values.view_as(part))
