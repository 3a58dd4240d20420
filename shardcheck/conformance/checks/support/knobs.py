"""The loop knobs of issue 60 (family training_loop, test_training_loop_knobs.py): a token-weighted
loss over padded micro-batches of varying length, judged against the same tokens in one batch on
one device, and the observed collectives of FSDP2's accumulation flags.

`TokenLM` is a tiny causal language model: ``head(prefix_mean(body(embed(ids))))`` where
``prefix_mean`` averages each position with those before it. Right padding therefore changes no
real position's output: a micro-batch padded to its own longest sequence and the same rows padded
to the longest of the whole step compute the same per-token losses. `token_batches` gives every
(rank, step, micro-batch) two sequences of lengths drawn from 1 to 9, so the number of target
tokens differs between ranks and micro-batches (the per-micro-batch means averaged are then not
the global token mean).

`OneBatchReference` is the yardstick of the token-weighted loss: one device holding the model, which
at the start of each step concatenates the micro-batches of EVERY rank into one batch (padded to its
longest row), takes the mean cross-entropy over its non-pad targets, backpropagates it, and steps
the recipe's optimizer (clipping first, if the recipe clips). No gradient is averaged and no count
is all-reduced: what the sharded loop must reproduce is what one device computes.

`CollectiveWatch` observes a candidate's micro-batches (parity.train_in_parity's `watch`): a
micro-batch whose gradient sync is on reduces gradients, one under no_sync reduces none, and with
`reshard_after_backward=False` a micro-batch after the first gathers no parameter (the previous
backward kept them unsharded) while a step's first does (its update is gathered afresh).
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from shardcheck.conformance.checks.support.parity import compare_steps
from shardcheck.conformance.measure.traffic import CollectiveCounter
from shardcheck.conformance.protocol import StepResult

VOCAB, WIDTH, ROWS, MAX_LEN, IGNORE = 16, 8, 2, 9, -100
UNITS = ("body",)


class TokenLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.body = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(ids))
        h = h + self.body(h)
        positions = torch.arange(1, h.shape[1] + 1, device=h.device, dtype=h.dtype).view(1, -1, 1)
        return self.head(h.cumsum(1) / positions)


def summed_loss(model, batch) -> torch.Tensor:
    """The sum of the cross-entropy over the micro-batch's non-pad targets (Recipe.tokens' loss_fn)."""
    ids, labels = batch
    logits = model(ids).float()
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=IGNORE, reduction="sum")


def target_tokens(batch) -> torch.Tensor:
    """How many targets the micro-batch counts: its non-pad labels (Recipe.tokens)."""
    return (batch[1] != IGNORE).sum()


def micro_batch(rank: int, step: int, j: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, labels) of one micro-batch: ROWS sequences of random lengths, right-padded (ids 0,
    labels IGNORE) to the longest of them. The same on whichever rank draws it."""
    g = torch.Generator().manual_seed(7919 * step + 101 * j + rank)
    lengths = torch.randint(1, MAX_LEN + 1, (ROWS,), generator=g)
    width = int(lengths.max())
    ids = torch.zeros(ROWS, width, dtype=torch.long)
    labels = torch.full((ROWS, width), IGNORE, dtype=torch.long)
    for row, n in enumerate(lengths.tolist()):
        ids[row, :n] = torch.randint(1, VOCAB, (n,), generator=g)
        labels[row, :n] = torch.randint(0, VOCAB, (n,), generator=g)
    return ids.to(device), labels.to(device)


def token_batches(world_size: int, steps: int, k: int, device) -> dict[int, list[list]]:
    """{rank: per step, the list of its k micro-batches} for every rank of the world."""
    return {r: [[micro_batch(r, s, j, device) for j in range(k)] for s in range(steps)] for r in range(world_size)}


def _pad(t: torch.Tensor, width: int, value: int) -> torch.Tensor:
    return F.pad(t, (0, width - t.shape[1]), value=value)


class OneBatchReference:
    """One device, the step's micro-batches of every rank in one batch (module doc); the interface
    parity.compare_steps drives (`begin_step`, `forward_backward`, `full_grads`, `step`, `full_params`)."""

    def __init__(self, model: nn.Module, recipe, every_rank: dict[int, list[list]], rank: int) -> None:
        self.model, self.recipe, self.every_rank, self.rank = model, recipe, every_rank, rank
        self.optimizer = recipe.optimizer.build(model.parameters())
        self.step_index, self.shares = 0, list[torch.Tensor]()

    def begin_step(self, micro_batches) -> None:
        """The step's one batch: forward, the mean over its targets, backward; each (rank, micro-batch)'s
        share of that mean kept for `forward_backward` to report."""
        steps = [self.every_rank[r][self.step_index] for r in sorted(self.every_rank)]
        mine = steps[self.rank]
        assert all(torch.equal(a, b) for m, n in zip(micro_batches, mine) for a, b in zip(m, n)), \
            "the candidate's micro-batches are not the ones drawn for this rank"
        parts = [part for step in steps for part in step]
        width = max(ids.shape[1] for ids, _ in parts)
        ids = torch.cat([_pad(i, width, 0) for i, _ in parts])
        labels = torch.cat([_pad(lab, width, IGNORE) for _, lab in parts])
        logits = self.model(ids).float()
        per_token = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=IGNORE,
                                    reduction="none").view(labels.shape)
        count = (labels != IGNORE).sum()
        (per_token.sum() / count).backward()
        rows = per_token.detach().split([i.shape[0] for i, _ in parts])
        k = len(mine)
        self.shares = [row.sum() / count for row in rows[self.rank * k:(self.rank + 1) * k]]

    def forward_backward(self, batch) -> torch.Tensor:
        return self.shares.pop(0)

    def full_grads(self) -> dict[str, torch.Tensor | None]:
        return {n: None if p.grad is None else p.grad.detach() for n, p in self.model.named_parameters()}

    def step(self) -> StepResult:
        total = None
        if self.recipe.clip is not None:
            total = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.recipe.clip.max_norm,
                                                         self.recipe.clip.norm_type))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step_index += 1
        return StepResult(total_norm=total)

    def full_params(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.model.named_parameters()}

    def keep(self) -> None:
        """parity.train_in_parity's shared-reference hook: nothing is shared."""


def train_token_weighted(ctx, impl, spec, recipe, steps: int) -> None:
    """`steps` of `recipe` (token-weighted, k micro-batches) on TokenLM: the candidate's trainer in
    parity with `OneBatchReference` after every micro-batch and step."""
    every_rank = token_batches(ctx.world_size, steps, recipe.accumulation_steps, ctx.device)
    counts = [int(target_tokens(m)) for r in every_rank for step in every_rank[r] for m in step]
    assert len(set(counts)) > 1, f"every micro-batch counts {counts[0]} tokens: nothing tells a global mean apart"
    with ctx.seeded(0):
        model = TokenLM().to(ctx.device)
    reference = OneBatchReference(copy.deepcopy(model), recipe, every_rank, ctx.rank)
    trainer = impl.trainer(model, spec, recipe)
    try:
        compare_steps(ctx, trainer, reference, recipe, every_rank[ctx.rank])
    finally:
        if hasattr(trainer, "close"):
            trainer.close()


class CollectiveWatch:
    """The collectives of each micro-batch of a candidate's run, judged against the recipe's knobs
    (module doc). The signature of parity.train_in_parity's `watch`."""

    def __init__(self, ctx, modules, spec, recipe, trainer=None) -> None:
        self.ctx, self.recipe, self.problems = ctx, recipe, list[str]()

    @contextlib.contextmanager
    def during(self, step: int, phase: str, micro: int = 0):
        with CollectiveCounter() as log:
            yield
        if phase != "forward_backward":
            return
        recipe, k = self.recipe, self.recipe.accumulation_steps
        where = f"step {step} micro-batch {micro} of {k}"
        reductions = [c for c in log.calls if c.reduces_floats]
        gathers = [c for c in log.calls if c.kind == "all_gather"]
        quiet = not recipe.sync_each_micro_batch and micro < k - 1
        if quiet and reductions:
            self.problems.append(f"{where}: gradients reduced ({reductions[0].kind}) although its gradient sync "
                                 "is off (set_requires_gradient_sync(False) / no_sync)")
        if not quiet and not reductions:
            self.problems.append(f"{where}: no gradient reduced although its gradient sync is on"
                                 + (" (marked not the last backward)" if recipe.mark_last_backward and micro < k - 1
                                    else ""))
        if not recipe.reshard_after_backward and micro > 0 and gathers:
            self.problems.append(f"{where}: {len(gathers)} all-gather(s) although the previous backward kept the "
                                 "parameters unsharded (set_reshard_after_backward(False))")
        if not recipe.reshard_after_backward and micro == 0 and not gathers:
            self.problems.append(f"{where}: no all-gather at a step's first micro-batch: the parameters kept "
                                 "unsharded past the last backward (the update not gathered)")

    def verify(self) -> None:
        """Raise the first problem, on every rank if any rank saw one (a collective)."""
        flag = torch.tensor([1 if self.problems else 0], dtype=torch.int32, device=self.ctx.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.ctx.group)
        if flag.item():
            raise AssertionError(self.problems[0] if self.problems else "another rank observed a broken knob")

    def close(self) -> None:
        pass
