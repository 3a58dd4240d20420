"""`checks/support/shared_reference`: cells that train alike replay one recorded run of the unsharded
reference, bit for bit what computing it again gives; anything that changes the training changes the
key; a run that is partial or drew random numbers is not kept; ranks that disagree all recompute. The
same for `computed_once`, a check's reference side written as a function."""

from __future__ import annotations

import torch

from shardcheck.conformance.adapters.reference import ReferenceAdapter
from shardcheck.conformance.checks.support import shared_reference
from shardcheck.conformance.checks.support.parity import train_in_parity
from shardcheck.conformance.checks.support.workloads import WORKLOADS, UnevenMLP
from shardcheck.conformance.protocol import Clip, MixedPrecision, Optimizer, Recipe, ShardSpec
from shardcheck.harness import distributed

MLP = WORKLOADS["uneven_mlp"]


def _cell(ctx, strategy="FULL_SHARD", **changes):
    recipe = Recipe(loss_fn=MLP.loss_fn, optimizer=changes.pop("optimizer", Optimizer("adam", lr=1e-2)),
                    clip=Clip(0.05, 2.0))
    spec = ShardSpec(strategy=strategy, units=MLP.units, mesh=ctx.mesh(), **changes)
    return spec, recipe


def _key(ctx, build, spec, recipe, batches):
    with ctx.seeded(0):
        model = build()
    return shared_reference.key(ctx, build, model, spec, recipe, batches)


@distributed(world_size=[2, 4])
def test_strategies_of_one_workload_share_one_recorded_run(ctx):
    build = lambda: UnevenMLP()  # a closure of this test: no other cell's recording matches it
    batches = MLP.batches(ctx, 3)
    full = _cell(ctx, "FULL_SHARD")
    key = _key(ctx, build, *full, batches)
    assert key == _key(ctx, build, *_cell(ctx, "NO_SHARD"), batches)  # sharding is not an input
    first = train_in_parity(ctx, ReferenceAdapter(), build, *full, batches)

    def must_not_compute():
        raise AssertionError("the reference was computed again")

    replay = shared_reference.replay_or_record(ctx, key, must_not_compute)
    assert isinstance(replay, shared_reference.Replay)
    second = train_in_parity(ctx, ReferenceAdapter(), build, *_cell(ctx, "SHARD_GRAD_OP"), batches)
    assert second == first  # the StepResults (total norms) of the replay are the recorded ones


@distributed(world_size=2)
def test_whatever_changes_the_training_changes_the_key(ctx):
    build = lambda: UnevenMLP()
    batches = MLP.batches(ctx, 2)
    base = _key(ctx, build, *_cell(ctx), batches)
    spec, recipe = _cell(ctx, optimizer=Optimizer("adam", lr=2e-2))
    other_batches = MLP.batches(ctx, 3)[1:]
    changed = {
        "optimizer": _key(ctx, build, spec, recipe, batches),
        "batches": _key(ctx, build, *_cell(ctx), other_batches),
        # the other rank's batches alone: this rank's averaged gradients are made of them too
        "another rank's batches": _key(ctx, build, *_cell(ctx), other_batches if ctx.rank == 1 else batches),
        "mixed precision": _key(ctx, build, *_cell(ctx, mixed_precision=MixedPrecision(
            param_dtype=torch.bfloat16)), batches),
        "build": _key(ctx, lambda: UnevenMLP(), *_cell(ctx), batches),
    }
    with ctx.seeded(0):
        model = build()
    with torch.no_grad():
        model.head.bias.add_(1e-7)
    changed["initial parameters"] = shared_reference.key(ctx, build, model, *_cell(ctx), batches)
    for what, key in changed.items():
        assert key != base, f"{what} changed but the key did not"
    # inputs with no digest on one rank: no key, and a run under no key is never kept
    odd = batches if ctx.rank == 0 else [*batches, object()]
    assert _key(ctx, build, *_cell(ctx), odd) is None
    recording = shared_reference.replay_or_record(ctx, None, lambda: _FakeReference(draws=False))
    assert isinstance(recording, shared_reference.Recording)


class _FakeReference:
    def __init__(self, draws: bool) -> None:
        self.draws = draws

    def forward_backward(self, batch):
        return torch.rand(()) if self.draws else torch.tensor(1.0)

    def full_grads(self):
        return {"w": torch.ones(2)}

    def step(self):
        return None

    def full_params(self):
        return {"w": torch.zeros(2)}


def _record(ctx, key, reference, *, complete: bool = True):
    # Under ctx.seeded: thread-mode ranks share one generator and take turns in seeded blocks, so
    # another rank's draw cannot land inside this recording (which would then, rightly, not be kept).
    with ctx.seeded(0):
        recording = shared_reference.Recording(reference, key, ctx.device)
        for _ in range(2):
            recording.forward_backward(None)
            recording.full_grads()
            recording.step()
            recording.full_params()
        if not complete:
            recording.forward_backward(None)  # a third step, which the candidate did not finish
        recording.keep()


@distributed(world_size=2)
def test_partial_or_random_runs_are_not_kept_and_disagreeing_ranks_recompute(ctx):
    kept, partial, random_, lopsided = (("test", name, ctx.rank) for name in ("kept", "partial", "random", "lopsided"))
    _record(ctx, kept, _FakeReference(draws=False))
    _record(ctx, partial, _FakeReference(draws=False), complete=False)
    _record(ctx, random_, _FakeReference(draws=True))
    if ctx.rank == 0:
        _record(ctx, lopsided, _FakeReference(draws=False))
    made = []
    for key in (kept, partial, random_, lopsided):
        got = shared_reference.replay_or_record(ctx, key, lambda: made.append(key) or _FakeReference(False))
        assert isinstance(got, shared_reference.Replay if key is kept else shared_reference.Recording), key
    assert made == [partial, random_, lopsided]



def _reference_side(calls: list, *, draw: bool = False):
    """A check's reference side (a new function per test, so no other test's result matches): it
    all-reduces, as a yardstick's gradient average does, and counts its calls."""
    def compute(ctx, scale):
        calls.append(scale)
        t = torch.full((3,), float(ctx.rank + 1))
        torch.distributed.all_reduce(t, group=ctx.group)
        if draw:
            torch.rand(())
        return {"sum": t * scale, "parts": [t.clone(), (scale,)]}
    return compute


@distributed(world_size=[2, 4])
def test_computed_once_per_arguments_and_copied(ctx):
    calls = []
    compute = _reference_side(calls)
    first = shared_reference.computed_once(ctx, compute, 2.0)
    want = torch.full((3,), 2.0 * sum(range(1, ctx.world_size + 1)))
    assert torch.equal(first["sum"], want)
    first["sum"].zero_()  # a cell that changes what it got changes nothing kept
    again = shared_reference.computed_once(ctx, compute, 2.0)
    assert torch.equal(again["sum"], want) and again["parts"][1] == (2.0,)
    assert calls == [2.0], "computed again for the same arguments"
    shared_reference.computed_once(ctx, compute, 3.0)
    assert calls == [2.0, 3.0], "other arguments must compute"


@distributed(world_size=2)
def test_computed_once_keeps_nothing_that_drew_random_numbers_or_one_rank_lacks(ctx):
    calls = []
    drawing = _reference_side(calls, draw=True)
    for _ in range(2):
        shared_reference.computed_once(ctx, drawing, 5.0)
    assert calls == [5.0, 5.0], "a result that drew random numbers was replayed"
    calls.clear()
    compute = _reference_side(calls)
    shared_reference.computed_once(ctx, compute, 7.0 if ctx.rank == 0 else 8.0)  # rank 0 alone holds 7.0
    shared_reference.computed_once(ctx, compute, 7.0)
    assert calls == [7.0 if ctx.rank == 0 else 8.0, 7.0], "ranks that disagree must all compute again"
