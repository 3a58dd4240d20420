"""Checkpoints (family checkpoint): resume, consolidated export and bad input, through the
candidate's own `Trainer.save` / `Trainer.load` / `Trainer.full_state_dict` (capability checkpoint).

After torch's `test_fsdp_state_dict.py` (save, load into a fresh model, train on: parity) and
`test_fsdp_optim_state.py` (optimizer state survives the round trip), judged as everything in the
behaviour layer is: step by step against unsharded data-parallel training that never stopped
(support/checkpoint.py). The suite never reads the candidate's files; it only damages them for the
bad-input cells (the largest file: a data file in any format).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException

from shardcheck.conformance.checks.support.checkpoint import (
    flip_bytes,
    index_files,
    largest_file,
    listing,
    train_across_checkpoint,
    trained_and_exported,
    truncate,
    working_in,
)
from shardcheck.conformance.checks.support.compare import assert_close
from shardcheck.conformance.checks.support.workloads import WORKLOADS, UnevenMLP
from shardcheck.conformance.protocol import Clip, LossScale, MixedPrecision, Optimizer, Recipe, ShardSpec
from shardcheck.conformance.protocol.capabilities import of_strategy
from shardcheck.harness import distributed

W = WORKLOADS["uneven_mlp"]
# What a resuming user's `except` catches: any Exception, and DCP's CheckpointException, which derives
# from BaseException (F32). Not pytest's Skipped / Failed, SystemExit or KeyboardInterrupt.
CATCHABLE = (Exception, CheckpointException)
ADAM = Recipe(loss_fn=W.loss_fn, optimizer=Optimizer("adam", lr=1e-2), clip=Clip(1.0, 2.0))


@distributed(world_size=[2, 4])
@pytest.mark.requires.with_args(lambda params: {of_strategy(params["strategy"]), "clip_norm_2", "checkpoint"})
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "SHARD_OPTIMIZER"])
def test_resume(ctx, impl, strategy, tmp_path):
    """2 steps, save, a fresh trainer loads, 2 more steps: Adam's step count and moments must come
    back (a lost step count changes the bias correction of the first update after the load)."""
    spec_of = lambda mesh: ShardSpec(strategy=strategy, units=W.units, mesh=mesh)  # noqa: E731
    train_across_checkpoint(ctx, impl, W, ADAM, tmp_path / "ckpt", save_size=ctx.world_size,
                            load_size=ctx.world_size, spec_of=spec_of)


@distributed(world_size=4)
@pytest.mark.requires("hybrid_shard", "clip_norm_2", "checkpoint")
def test_resume_hybrid(ctx, impl, tmp_path):
    """HYBRID_SHARD on a (replicate=2, shard=2) mesh: each replica saves the same shards; the load
    must give both replicas the state, and training continue as unsharded training would."""
    hybrid = ctx.mesh((2, 2), ("replicate", "shard"))
    spec_of = lambda mesh: ShardSpec(strategy="HYBRID_SHARD", units=W.units, mesh=hybrid)  # noqa: E731
    train_across_checkpoint(ctx, impl, W, ADAM, tmp_path / "ckpt", save_size=4, load_size=4, spec_of=spec_of)


@distributed(world_size=[2, 4])
@pytest.mark.requires("full_shard", "clip_norm_2", "loss_scaling", "mixed_precision_bf16", "checkpoint")
def test_resume_loss_scaling(ctx, impl, tmp_path):
    """bf16 compute with dynamic loss scaling: step 0 is poisoned (skip, back off to 2^9), step 1
    finite (growth tracker 1), save; after the load step 2 must GROW the scale (tracker 2 of 2), so
    both the scale and the growth tracker must have been restored."""
    scaling = LossScale(init_scale=2.0 ** 10, growth_factor=2.0, backoff_factor=0.5, growth_interval=2)
    recipe = Recipe(loss_fn=W.loss_fn, optimizer=Optimizer("adam", lr=1e-2), clip=Clip(1.0, 2.0),
                    loss_scale=scaling)
    spec_of = lambda mesh: ShardSpec(units=W.units, mesh=mesh,  # noqa: E731
                                     mixed_precision=MixedPrecision(torch.bfloat16, torch.float32))
    results = train_across_checkpoint(ctx, impl, W, recipe, tmp_path / "ckpt", save_size=ctx.world_size,
                                      load_size=ctx.world_size, spec_of=spec_of, poison={0: math.inf},
                                      dtype=torch.bfloat16)
    # The reference itself must show the behaviour, or the comparison proves nothing.
    assert [r.skipped for r in results] == [True, False, False, False], results
    assert [r.scale for r in results] == [2.0 ** 9, 2.0 ** 9, 2.0 ** 10, 2.0 ** 10], results


@distributed(world_size=[2, 4])
@pytest.mark.requires("full_shard", "clip_norm_2", "checkpoint")
def test_consolidated_export(ctx, impl):
    """After 2 steps, `full_state_dict()` loads into the plain unsharded model with strict=True, equals
    the unsharded run's state, and the plain model computes the same loss on a new batch."""
    batches = W.batches(ctx, 3)
    exported, ref = trained_and_exported(ctx, impl, W.build, ShardSpec(units=W.units, mesh=ctx.mesh()), ADAM, batches[:2])
    plain = W.build().to(ctx.device)
    plain.load_state_dict(exported, strict=True)
    assert_close(ctx, dict(plain.state_dict()), dict(ref.master.state_dict()), "exported state dict")
    with torch.no_grad():
        assert_close(ctx, W.loss_fn(plain, batches[2]), W.loss_fn(ref.master, batches[2]),
                     "the exported model's loss")


class WiderMLP(UnevenMLP):
    """UnevenMLP with a first layer 6 wide, not 5: the same parameter names, other shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.body[0], self.body[2] = nn.Linear(7, 6), nn.Linear(6, 3)


RESHAPED = ("body.0.weight", "body.0.bias", "body.2.weight")


def damage_checkpoint(path, damage: str) -> str:
    """Damage the saved checkpoint; return what the load's error must name."""
    if damage in ("truncated", "flipped"):
        victim = largest_file(path)
        (truncate if damage == "truncated" else flip_bytes)(victim)
        return victim.name
    if damage == "missing_shard":
        victim = largest_file(path)
        victim.unlink()
        return victim.name
    if damage in ("missing_index", "truncated_index"):
        victims = index_files(path)
        for victim in victims:
            victim.unlink() if damage == "missing_index" else truncate(victim)
        return tuple(v.name for v in victims)
    return "other_shape"


@distributed(world_size=2)
@pytest.mark.requires("full_shard", "checkpoint")
@pytest.mark.parametrize("damage", ["truncated", "flipped", "missing_shard", "missing_index", "truncated_index",
                                    "other_shape"])
def test_bad_input(ctx, impl, damage, tmp_path):
    """A damaged checkpoint (its largest data file cut in half, or with bytes flipped in place at the
    same size, or missing; its index file missing or cut in half), or one of a model with other
    shapes, must make `load` raise on every rank
    an error naming what is wrong (the damaged file; a parameter whose shape differs), of a type users
    catch (an Exception, or DCP's CheckpointException), and the load must write nothing outside the
    checkpoint's directory."""
    path = tmp_path / "ckpt"
    with ctx.seeded(0):
        model = W.build().to(ctx.device)
    recipe = Recipe(loss_fn=W.loss_fn, optimizer=Optimizer("adam", lr=1e-2))
    trainer = impl.trainer(model, ShardSpec(units=W.units, mesh=ctx.mesh()), recipe)
    try:
        trainer.forward_backward(W.batches(ctx, 1)[0])
        trainer.step()
        trainer.save(path)
    finally:
        if hasattr(trainer, "close"):
            trainer.close()
    ctx.barrier()
    assert listing(tmp_path) == {"ckpt"}, f"save wrote outside its directory: {sorted(listing(tmp_path))}"
    named = ctx.all_gather_object(damage_checkpoint(path, damage) if ctx.rank == 0 else None)[0]
    ctx.barrier()
    build = WiderMLP if damage == "other_shape" else W.build
    with ctx.seeded(1):
        fresh = build().to(ctx.device)
    trainer = impl.trainer(fresh, ShardSpec(units=W.units, mesh=ctx.mesh()), recipe)
    outside = listing(tmp_path) | {"cwd"}
    try:
        with working_in(ctx, tmp_path / "cwd") as cwd, pytest.raises(CATCHABLE) as raised:
            trainer.load(path)
    finally:
        if hasattr(trainer, "close"):
            trainer.close()
    message = str(raised.value)
    wanted = RESHAPED if damage == "other_shape" else named if isinstance(named, tuple) else (named,)
    assert any(w in message for w in wanted), (
        f"load of a checkpoint ({damage}) raised {type(raised.value).__name__}: {message[:300]!r} ... "
        f"{(message.strip().splitlines() or [''])[-1][:200]!r}, which names none of {list(wanted)}")
    wrote = sorted(listing(tmp_path) ^ outside) + sorted(f"./{name}" for name in listing(cwd))
    assert not wrote, f"load wrote outside the checkpoint's directory: {wrote}"
