"""The token-weighted loss has two yardsticks that share no code: unsharded data-parallel training
(`dp_reference.DataParallelReference`: the count all-reduced, each rank's gradients of loss / N
summed) and one device on the step's tokens of every rank in one batch (`knobs.OneBatchReference`,
what the knobs' cells judge against). They must agree micro-batch by micro-batch, and per-micro-batch
means averaged must not (else the data could not tell the bug apart)."""

from __future__ import annotations

import copy

import pytest
import torch

from shardcheck.conformance.checks.support import knobs
from shardcheck.conformance.checks.support.dp_reference import DataParallelReference
from shardcheck.conformance.checks.support.parity import compare_steps
from shardcheck.conformance.protocol import Optimizer, Recipe, ShardSpec
from shardcheck.harness import distributed

K, STEPS = 3, 2


def _recipe(sync: str) -> Recipe:
    return Recipe(loss_fn=knobs.summed_loss, optimizer=Optimizer("sgd", lr=0.1, momentum=0.9), accumulation_steps=K,
                  sync_each_micro_batch=sync == "every", tokens=knobs.target_tokens)


@distributed(world_size=[2, 4])
@pytest.mark.parametrize("sync", ["every", "last"])
def test_data_parallel_and_one_batch_yardsticks_agree(ctx, sync):
    recipe = _recipe(sync)
    every_rank = knobs.token_batches(ctx.world_size, STEPS, K, ctx.device)
    with ctx.seeded(0):
        model = knobs.TokenLM().to(ctx.device)
    one_batch = knobs.OneBatchReference(copy.deepcopy(model), recipe, every_rank, ctx.rank)
    data_parallel = DataParallelReference(copy.deepcopy(model), ShardSpec(mesh=ctx.mesh()), recipe, ctx.group)
    compare_steps(ctx, data_parallel, one_batch, recipe, every_rank[ctx.rank])


def test_per_micro_batch_means_are_not_the_global_mean():
    """On the knobs' batches, averaging each micro-batch's own mean weighs tokens otherwise than the
    mean over every target of the step (world size 2, step 0): the gradients differ by far more than
    any tolerance. (The losses themselves differ little at initialisation, where every token's loss
    is near log(VOCAB): the cells compare gradients after every step.)"""
    model = knobs.TokenLM()
    parts = [knobs.micro_batch(r, 0, j, "cpu") for r in range(2) for j in range(K)]
    counts = [int(knobs.target_tokens(p)) for p in parts]
    sums = [knobs.summed_loss(model, p) for p in parts]

    def grads(loss):
        return torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)])

    global_mean = grads(sum(sums) / sum(counts))
    mean_of_means = grads(sum(s / n for s, n in zip(sums, counts)) / len(parts))
    relative = float((global_mean - mean_of_means).norm() / global_mean.norm())
    assert len(set(counts)) > 1 and relative > 0.05, (counts, relative)
