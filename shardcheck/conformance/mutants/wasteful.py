"""Mutants that train exactly right and waste what sharding is for: the liars the family sharding
(shardcheck/conformance/checks/behaviour/test_sharding.py) must catch from measured memory and traffic alone.
Each passes every numeric check: their gradients, norms and parameters are those of the reference."""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist

from shardcheck.conformance.mutants.base import MutantAdapter, before_shard, replace
from shardcheck.conformance.protocol.torch_style import TorchStyleTrainer

SHARDING_CHECKS = ("test_sharding.py::test_sharding", "test_sharding.py::test_sharding_hybrid")


def _sharding():
    return importlib.import_module("shardcheck.reference_impl.sharding")


class ReplicatesDeclaresFullShard(MutantAdapter):
    """Every unit is built NO_SHARD whatever the strategy asked (over the whole world): whole
    parameters, gradients and optimizer state on every rank, gradients all-reduced. It trains
    exactly like unsharded data parallelism, as an adapter that wraps DDP and declares FULL_SHARD."""

    name = "mutant-replicates-declares-full-shard"
    bug = "replicates every parameter while declaring FULL_SHARD (SHARD_GRAD_OP, HYBRID_SHARD)"
    checks = SHARDING_CHECKS
    world_sizes = (2, 4)

    def patch(self) -> None:
        ri = importlib.import_module("shardcheck.reference_impl")
        original = ri.shard

        def replicating(module, *, mesh=None, process_group=None, strategy=None, **kwargs):
            flat = mesh if mesh is None or mesh.ndim == 1 else None  # a 2-D mesh: the whole world
            return original(module, mesh=flat, process_group=process_group,
                            strategy=ri.ShardingStrategy.NO_SHARD, **kwargs)

        replace(ri, "shard", replicating)


class NoReshardAfterForward(MutantAdapter):
    """FULL_SHARD (and HYBRID_SHARD) keep every unit's gathered parameters from forward to backward,
    as SHARD_GRAD_OP does: one all-gather per step saved, the whole model held at its peak."""

    name = "mutant-no-reshard-after-forward"
    bug = "FULL_SHARD never reshards after forward (gathered parameters kept until backward)"
    checks = SHARDING_CHECKS
    world_sizes = (2, 4)

    def patch(self) -> None:
        S = _sharding()
        replace(S.Unit, "frees_after_forward", property(lambda unit: False))


class _FullStateTrainer(TorchStyleTrainer):
    """The reference's step with the optimizer's moments allocated for the whole (unsharded)
    parameter on every rank, of which each rank updates its shard's first elements only."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.optimizer.register_step_pre_hook(self._allocate_full_state)

    def _allocate_full_state(self, optimizer, *_):
        world = dist.get_world_size()
        for group in optimizer.param_groups:
            for p in group["params"]:
                state = optimizer.state[p]
                if state or p.grad is None or group.get("betas") is None:
                    continue
                state["step"] = torch.tensor(0.0)
                for key in ("exp_avg", "exp_avg_sq"):
                    full = torch.zeros(p.numel() * world, dtype=p.dtype, device=p.device)
                    state[key] = full[: p.numel()].view_as(p)


class UnshardedOptimizerState(MutantAdapter):
    """Adam's moments allocated at the full parameter size on every rank (an optimizer built over
    the unsharded flat buffer, each rank stepping its own slice): parameters and gradients sharded,
    optimizer state not."""

    name = "mutant-unsharded-optimizer-state"
    bug = "optimizer state kept at full size on every rank (parameters and gradients sharded)"
    checks = SHARDING_CHECKS
    world_sizes = (2, 4)

    def patch(self) -> None:
        pass  # the trainer is the mutant: nothing of reference_impl changes

    def trainer(self, model, spec, recipe):
        return _FullStateTrainer(self, model, spec, recipe)


class RootLeftReplicated(MutantAdapter):
    """The root's own parameters (those of no unit: a language model's embedding, output projection
    and final norm) kept whole on every rank and all-reduced, the units sharded as asked, as an
    engine that shards the wrapped blocks alone. It trains exactly right. On the family sharding's
    model the root holds 0.8% of the parameters, within the promises' bookkeeping slack (SMALL); on
    llama (test_models_composed.py) a third."""

    name = "mutant-root-left-replicated"
    bug = "the root's own parameters (embedding, output projection) replicated, only the units sharded"
    checks = ("test_models_composed.py::test_model_sharding",)
    needs_zoo = True

    def patch(self) -> None:
        ri = importlib.import_module("shardcheck.reference_impl")
        S = _sharding()
        original = ri.shard

        def shard(module, **kwargs):
            if any(S.unit_of(m) is not None for m in module.modules() if m is not module):  # the root, last
                kwargs["strategy"] = ri.ShardingStrategy.NO_SHARD
            return original(module, **kwargs)

        replace(ri, "shard", shard)


# -- liars that the coarse rows let through: each breaks one promise row of the family's cells ----
# `rows`: the promise rows (shardcheck/conformance/measure/promises.py) its killing cell must fail, exactly.

class _Prefetched:
    """Process-wide state of the gather-everything mutant: full tensors gathered ahead, by unit."""

    cache: dict = {}
    root = None
    in_backward = False


class GatherAllAtForwardStart(MutantAdapter):
    """FULL_SHARD that gathers every unit when the root's forward starts, and every unit again at
    once when backward starts (a "prefetch everything" schedule): each unit is gathered as often as
    the design says, so the traffic is right, and resharded as promised; only the number of units
    gathered at the same moment is wrong, which is what FULL_SHARD exists to bound."""

    name = "mutant-gather-all-at-forward-start"
    bug = "FULL_SHARD gathers every unit at once when forward starts and again when backward starts"
    checks = ("test_sharding.py::test_sharding",)
    world_sizes = (2, 4)
    rows = ("gathered during forward", "gathered during backward", "peak during the step")

    def patch(self) -> None:
        S = _sharding()
        gather, reduce = S.Unit.all_gather, S.Unit.reduce_grads

        def prefetching(unit, param_dtype=None, skip=None):
            state = _Prefetched
            if param_dtype is not None or skip is not None or not unit.frees_after_forward:
                return gather(unit, param_dtype, skip)
            if id(unit) in state.cache:
                return state.cache.pop(id(unit))
            if unit.is_root:  # forward starts: every other unit now
                state.root, state.in_backward = unit.module, False
                others = [u for u in S.units(unit.module, adopt=False) if u is not unit]
            elif state.root is not None and not state.in_backward and not torch.is_grad_enabled():
                state.in_backward = True  # backward's first re-gather: every unit still resharded
                others = [u for u in S.units(state.root, adopt=False) if u is not unit and u.full is None]
            else:
                others = []
            for other in others:
                state.cache[id(other)] = gather(other)
            return gather(unit)

        def reducing(unit, grads):
            reduce(unit, grads)
            if unit.is_root:  # the end of backward: nothing gathered ahead may outlive it
                _Prefetched.cache.clear()

        replace(S.Unit, "all_gather", prefetching)
        replace(S.Unit, "reduce_grads", reducing)


class AllReduceThenSlice(MutantAdapter):
    """Sharded gradients from an all-reduce of the whole gradient, each rank keeping its slice,
    instead of a reduce-scatter: the right averaged shard, twice the bytes on the wire (as DeepSpeed
    ZeRO-1/2's bucketed all-reduce, F35)."""

    name = "mutant-all-reduce-then-slice"
    bug = "gradients all-reduced whole and sliced instead of reduce-scattered"
    checks = ("test_sharding.py::test_sharding",)
    world_sizes = (2, 4)
    rows = ("reduce_scatter bytes sent", "all_reduce bytes sent")

    def patch(self) -> None:
        C = importlib.import_module("shardcheck.reference_impl.collectives")
        original = C.average_gradient

        def all_reduced(flat, shard_group, replicate_group, factor=None):
            sws = C.group_size(shard_group)
            if sws == 1:
                return original(flat, shard_group, replicate_group, factor)
            full = flat / (factor or sws * C.group_size(replicate_group))
            dist.all_reduce(full, group=shard_group)
            if C.group_size(replicate_group) > 1:
                dist.all_reduce(full, group=replicate_group)
            size = flat.numel() // sws
            return full[C.group_rank(shard_group) * size:(C.group_rank(shard_group) + 1) * size].clone()

        replace(C, "average_gradient", all_reduced)


class ExtraParameterCopy(MutantAdapter):
    """Sharding keeps an unsharded copy of every unit's parameters on every rank (a "master copy"
    taken before sharding and never freed): every figure the step produces is right; only the bytes
    held between steps grow by the whole model."""

    name = "mutant-extra-parameter-copy"
    bug = "an unsharded copy of the parameters kept on every rank"
    checks = ("test_sharding.py::test_sharding",)
    world_sizes = (2, 4)
    rows = ("held between steps",)

    def patch(self) -> None:
        def copying(module):
            module._mutant_full_copy = [p.detach().clone() for p in module.parameters()]

        before_shard(copying)


class TwoUnitsKeptAfterForward(MutantAdapter):
    """FULL_SHARD that keeps the last two units gathered from forward to backward (their backward
    comes first: a plausible saving of two re-gathers), while resharding the others."""

    name = "mutant-two-units-kept-after-forward"
    bug = "FULL_SHARD keeps two units gathered after forward"
    checks = ("test_sharding.py::test_sharding",)
    world_sizes = (2, 4)
    rows = ("kept gathered after forward", "all_gather bytes sent")

    def patch(self) -> None:
        S, ri = _sharding(), importlib.import_module("shardcheck.reference_impl")
        original, frees = ri.shard, S.Unit.frees_after_forward

        def marking(module, **kwargs):
            out = original(module, **kwargs)
            unit = S.unit_of(module)
            if unit is not None and unit.is_root:
                for kept in [u for u in S.units(module, adopt=False) if not u.is_root][-2:]:
                    kept.module._mutant_keep_gathered = True
            return out

        replace(ri, "shard", marking)
        replace(S.Unit, "frees_after_forward", property(
            lambda unit: frees.fget(unit) and not getattr(unit.module, "_mutant_keep_gathered", False)))


class GatherTwiceInBackward(MutantAdapter):
    """FULL_SHARD whose backward re-gather runs twice per unit, the first result dropped (as an
    activation-checkpointed unit that re-gathers in recompute and again in backward)."""

    name = "mutant-gather-twice-in-backward"
    bug = "FULL_SHARD all-gathers each unit twice in backward"
    checks = ("test_sharding.py::test_sharding",)
    world_sizes = (2, 4)
    rows = ("all_gather bytes sent",)

    def patch(self) -> None:
        S = _sharding()
        original = S.Unit.full_for_backward

        def twice(unit):
            if unit.full is None:
                with torch.no_grad():
                    unit.all_gather()  # gathered, then dropped
            return original(unit)

        replace(S.Unit, "full_for_backward", twice)


class _BucketTrainer(TorchStyleTrainer):
    """The reference's step, with every unit's full gradient buffer kept in an engine-owned bucket
    from its reduction until the optimizer step."""

    def step(self):
        out = super().step()
        for unit in _sharding().units(self.model, adopt=False):
            unit.__dict__.pop("_mutant_bucket", None)
        return out


class FullGradientBucket(MutantAdapter):
    """Each unit's unsharded gradient buffer (the reduce-scatter's input) kept in the engine's own
    bucket from backward to the optimizer step: `.grad` holds the right shard, and a bucket no
    `.grad` names holds the whole gradient (as DeepSpeed's reduce buckets)."""

    name = "mutant-full-gradient-bucket"
    bug = "gradients kept full-size in an engine-owned buffer until the step"
    checks = ("test_sharding.py::test_sharding",)
    world_sizes = (2, 4)
    rows = ("gradients after backward", "held after backward", "peak during the step")

    def patch(self) -> None:
        S = _sharding()
        original = S.Unit.communicate

        def bucketed(unit, flat):
            unit.__dict__["_mutant_bucket"] = flat
            return original(unit, flat)

        replace(S.Unit, "communicate", bucketed)

    def trainer(self, model, spec, recipe):
        return _BucketTrainer(self, model, spec, recipe)


class WholeOptimizerState(MutantAdapter):
    """SHARD_OPTIMIZER declared, the optimizer left whole: DDP with a plain Adam, as an adapter that
    maps ZeRO-1 to its engine's replication would be. It trains exactly like the reference (every
    rank steps every parameter), holds the whole optimizer state and redistributes nothing."""

    name = "mutant-whole-optimizer-state"
    bug = "SHARD_OPTIMIZER declared, optimizer state kept whole on every rank (plain DDP + Adam)"
    checks = ("test_sharding.py::test_sharding",)
    world_sizes = (4,)  # at 2 ranks the whole state still fits "held between steps": its gradient allowance
    cells = ("test_sharding[*-SHARD_OPTIMIZER]",)
    rows = ("held between steps", "optimizer state", "all_gather or broadcast bytes sent")

    def patch(self) -> None:
        ri = importlib.import_module("shardcheck.reference_impl")
        replace(ri, "ShardedOptimizer", lambda params, build, group: build(params))
