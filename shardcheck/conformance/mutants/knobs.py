"""Mutants of the loop's knobs (test_training_loop_knobs.py; issue 60): a token-weighted loss, and
gradients kept local, parameters kept unsharded and the last backward marked across micro-batches.

The token-weighted loss is written in the loop, not in the engine (protocol/torch_style.py: the
count all-reduced in `begin_step`, the engine's average undone), so its two mutants are the reference
adapter with a broken trainer, the bugs users' loops had: transformers' Trainer averaged each
micro-batch's own mean for years, and its first fix (4.46) counted each device's tokens without
gathering them across devices. The others patch reference_impl (sharding.py, unsynced.py), or the
reference adapter's mapping of `set_is_last_backward`.

Each names `cells`: the cells of its checks at world size 2 that must fail, every other one passing.
"""

from __future__ import annotations

import contextlib
import importlib

import torch

from shardcheck.conformance.mutants.base import MutantAdapter, replace
from shardcheck.conformance.protocol.torch_style import TorchStyleTrainer

TOKENS = ("test_training_loop_knobs.py::test_token_weighted_loss", "test_training_loop_knobs.py::test_token_weighted_loss_summed")
TOKEN_CELLS = ("test_token_weighted_loss[*]", "test_token_weighted_loss_summed[*]")
FLAGS = "test_training_loop_knobs.py::test_accumulation_flags"
KEPT_CELLS = ("test_accumulation_flags[ws2-*-reshard_after_backward]", "test_accumulation_flags[ws2-*-torch_pattern]")


def _module(name: str):
    return importlib.import_module(f"shardcheck.reference_impl.{name}")


class _PerMicroBatchMeans(TorchStyleTrainer):
    """Each micro-batch's loss divided by its own token count, then by the number of micro-batches."""

    def begin_step(self, micro_batches) -> None:
        pass

    def forward_backward(self, batch) -> torch.Tensor:
        k = self.recipe.accumulation_steps
        self.micro = getattr(self, "micro", 0) + 1
        quiet = self.micro % k != 0 and not self.recipe.sync_each_micro_batch
        with self.adapter.no_sync(self.model) if quiet else contextlib.nullcontext():
            tokens = self.recipe.tokens
            assert tokens is not None
            loss = self.recipe.loss_fn(self.model, batch) / tokens(batch)
            (loss / k).backward()
        return loss.detach()


class _RankLocalCount(TorchStyleTrainer):
    """The step's count taken over this rank's micro-batches only, and no world-size correction: each
    rank's own token mean, averaged over the ranks by the engine."""

    def begin_step(self, micro_batches) -> None:
        tokens = self.recipe.tokens
        assert tokens is not None
        self.tokens = torch.stack([torch.as_tensor(tokens(b)).double() for b in micro_batches]).sum()

    def forward_backward(self, batch) -> torch.Tensor:
        k = self.recipe.accumulation_steps
        self.micro = getattr(self, "micro", 0) + 1
        quiet = self.micro % k != 0 and not self.recipe.sync_each_micro_batch
        with self.adapter.no_sync(self.model) if quiet else contextlib.nullcontext():
            loss = self.recipe.loss_fn(self.model, batch) / self.tokens.float()
            loss.backward()
        return loss.detach()


class TokenMeanPerMicroBatch(MutantAdapter):
    """A token-weighted loss normalized per micro-batch: each micro-batch's mean over its own targets,
    averaged over micro-batches and ranks. Equal to the global token mean only when every micro-batch
    counts as many tokens; the padded micro-batches of varying length here do not."""

    name = "mutant-token-mean-per-micro-batch"
    bug = "token-weighted loss normalized per micro-batch (micro-batch means averaged, not the global token mean)"
    checks = TOKENS
    cells = TOKEN_CELLS

    def patch(self) -> None:
        pass  # the bug is the trainer's (module doc)

    def trainer(self, model, spec, recipe):
        return _PerMicroBatchMeans(self, model, spec, recipe)


class TokenCountLocal(MutantAdapter):
    """A token-weighted loss whose count is not all-reduced: each rank divides by its own tokens and
    the engine averages over the ranks, so a rank with few tokens weighs as much as one with many."""

    name = "mutant-token-count-local"
    bug = "token count of the rank's own micro-batches, not all-reduced (each rank's token mean averaged)"
    checks = TOKENS
    cells = TOKEN_CELLS

    def patch(self) -> None:
        pass  # the bug is the trainer's (module doc)

    def trainer(self, model, spec, recipe):
        return _RankLocalCount(self, model, spec, recipe)


class ReshardFlagIgnored(MutantAdapter):
    """set_reshard_after_backward(False) accepted and ignored: every backward drops the gathered
    parameters and every micro-batch gathers them again (the numbers are right; the promise of no
    all-gather between micro-batches is not kept)."""

    name = "mutant-reshard-flag-ignored"
    bug = "reshard_after_backward=False ignored: parameters gathered again on every micro-batch"
    checks = (FLAGS,)
    cells = KEPT_CELLS

    def patch(self) -> None:
        replace(_module("sharding"), "keep_or_reshard", lambda unit: unit.reshard())


class KeptPastLastBackward(MutantAdapter):
    """A unit that once kept its parameters after backward keeps them after the last backward too
    (the flag's return to True not honoured): the next step's first forward computes with the
    parameters as they were before the optimizer step."""

    name = "mutant-kept-past-last-backward"
    bug = "parameters kept unsharded past a step's last backward: the next step computes with pre-step values"
    checks = (FLAGS,)
    cells = KEPT_CELLS

    def patch(self) -> None:
        sharding = _module("sharding")

        def keep_or_reshard(unit) -> None:
            unit.__dict__["_kept_once"] = unit.__dict__.get("_kept_once", False) or not unit.reshard_after_backward
            if unit.__dict__["_kept_once"] and unit.full is not None:
                unit.kept = [None if f is None else f.detach() for f in unit.full]
            unit.reshard()

        replace(sharding, "keep_or_reshard", keep_or_reshard)


class NoSyncReducesTwice(MutantAdapter):
    """Under no_sync each micro-batch's gradients are reduced anyway AND held, and the last micro-batch
    reduces the held sum again: the first k-1 micro-batches count twice."""

    name = "mutant-no-sync-reduces-twice"
    bug = "gradients reduced under no_sync and again, held, on the last micro-batch (counted twice)"
    checks = (FLAGS,)
    cells = KEPT_CELLS  # the cells whose gradient sync is off on the first micro-batches

    def patch(self) -> None:
        sharding, unsynced = _module("sharding"), _module("unsynced")
        original = sharding.Unit.reduce_grads

        def reduce_grads(self, grads) -> None:
            if self.sync:
                return original(self, grads)
            held, self.unsynced, self.sync = self.unsynced, None, True
            try:
                original(self, grads)
            finally:
                self.sync, self.unsynced = False, held
            unsynced.hold(self, grads)

        replace(sharding.Unit, "reduce_grads", reduce_grads)


class LastBackwardDefersReduction(MutantAdapter):
    """set_is_last_backward(False) taken as the gradient sync switch: a micro-batch whose sync is on but
    which is not marked the last reduces nothing, its gradients held for the last (the sum comes out
    right; the reduction the user asked for on each micro-batch is not made)."""

    name = "mutant-last-backward-defers-reduction"
    bug = "set_is_last_backward(False) taken as no gradient sync: reductions deferred to the backward marked last"
    checks = (FLAGS,)
    cells = ("test_accumulation_flags[ws2-*-last_backward]",)

    def patch(self) -> None:
        pass  # the bug is the adapter's mapping of the mark (module doc)

    def set_is_last_backward(self, model, flag) -> None:
        import shardcheck.reference_impl as ri

        for unit in ri.units(model, adopt=False):
            unit.sync = flag


EXPERTS = ("test_training_loop_knobs_experts.py::test_idle_experts",)


class IdleExpertGradDropped(MutantAdapter):
    """A rank that routed no token to an expert keeps its gradient None after the reduction: the
    reduction counted the missing gradient as zeros and gave this rank's rows the other ranks'
    contribution / W, which the rank then drops (its rows of the expert never step: FULL_SHARD), or
    its replica is left unstepped while the others step (NO_SHARD). What a reduction that decides
    None or not from the local gradient alone does, without agreeing it across ranks as DDP's
    find_unused_parameters does."""

    name = "mutant-idle-expert-grad-dropped"
    bug = "an expert idle on a rank keeps a None gradient there: the other ranks' reduced contribution dropped"
    checks = EXPERTS
    cells = ("test_idle_experts[ws2-*-idle_on_a_rank]",)

    def patch(self) -> None:
        replace(_module("routed"), "used_anywhere", lambda unit, local: local)


class IdleExpertZeroGrad(MutantAdapter):
    """Every parameter of a unit gets the reduced gradient, zeros for an expert no rank routed a token
    to (the reduction of zeros for what is unused, without the used flags that keep it None): AdamW
    then decays that expert and steps it by its moments, where unsharded training skips it."""

    name = "mutant-idle-expert-zero-grad"
    bug = "an expert idle on every rank given a zero gradient: AdamW decays it and steps its moments"
    checks = EXPERTS
    cells = ("test_idle_experts[ws2-*-idle_everywhere]",)

    def patch(self) -> None:
        replace(_module("routed"), "used_anywhere", lambda unit, local: [True] * len(local))


class ExpertMeshUnreplicated(MutantAdapter):
    """The experts' unit sharded over the shard dimension of their mesh alone (the 1-D dp_shard_mod_ep
    sub-mesh handed to the wrapper instead of the 2-D mesh): their gradients are averaged within it and
    never across the other dimension, so the expert replicas drift apart and each holds the mean of
    its own group's tokens (at world size 2, (2, 1): no reduction at all)."""

    name = "mutant-expert-mesh-unreplicated"
    bug = "experts sharded over their sub-mesh's shard dimension alone: gradients never reduced across the other"
    checks = ("test_training_loop_knobs_experts.py::test_experts_on_their_own_mesh",)
    cells = ("test_experts_on_their_own_mesh[ws2-*]",)

    def patch(self) -> None:
        pass  # the bug is the adapter's mapping of the mesh (class doc)

    def shard(self, model, spec):
        import dataclasses

        import shardcheck.reference_impl as ri

        for path, mesh in spec.unit_meshes.items():
            ri.shard(model.get_submodule(path), mesh=mesh[mesh.mesh_dim_names[-1]], strategy=ri.ShardingStrategy.FULL_SHARD)
        return super().shard(model, dataclasses.replace(spec, unit_meshes={}))


class IdleExpertMeanOverUsers(MutantAdapter):
    """An expert's gradient averaged over the ranks that used it instead of the world: the sum divided by
    their count, as a reduction that leaves out the ranks without a gradient and divides by those left
    (an expert used by 1 of 2 ranks gets that rank's whole gradient, not half of it)."""

    name = "mutant-idle-expert-mean-over-users"
    bug = "an expert's gradient divided by the number of ranks that used it, not by the world size"
    checks = EXPERTS
    cells = ("test_idle_experts[ws2-*-idle_on_a_rank]",)

    def patch(self) -> None:
        import torch
        import torch.distributed as dist

        routed, sharding = _module("routed"), _module("sharding")
        scales: list[float] = []

        def used_anywhere(unit, local):
            if not unit.reduce_unused:
                return local
            counts = torch.tensor(local, dtype=torch.int32, device=unit.device)
            dist.all_reduce(counts, group=unit.dp_group)
            size = dist.get_world_size(unit.dp_group)
            scales.extend(size / c for c in counts.tolist() if c)
            return [bool(c) for c in counts.tolist()]

        original = sharding._accumulate

        def accumulate(param, grad, dtype):
            return original(param, grad * scales.pop(0) if scales else grad, dtype)

        replace(routed, "used_anywhere", used_anywhere)
        replace(sharding, "_accumulate", accumulate)
