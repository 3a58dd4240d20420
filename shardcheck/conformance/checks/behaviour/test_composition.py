"""Compositions (family composition): what people build on a sharded trainer, each trained step by
step against unsharded data-parallel training of the same model built the plain way. From torch's
own suites, for torch's FSDP only there (`test_fully_shard_training.py` ...
`test_train_parity_with_activation_checkpointing`, `TestFullyShardMetaDeviceInit`,
`test_train_parity_multi_group_cpu_offload_eager`); here for any engine, each composition a
capability (an engine that cannot do one gets unsupported, with its reason).

* activation checkpointing, three ways users apply it to each layer (torch.utils.checkpoint in the
  model's forward, checkpoint_wrapper, the composable checkpoint), the layers' sub-modules units of
  their own or not: the numbers equal training without it, the step sends no more than the same
  engine without it or the strategy's promise (recompute must not gather a unit a second time), and
  forward leaves less held for backward;
* meta-device init: a model built on meta, handed to the trainer, which materializes only what its
  rank holds: the parameters it ends with agree on every rank, follow the modules' own
  `reset_parameters`, a tied weight stays one parameter, a non-persistent buffer is initialized (the
  first loss shows it), and training from those values equals unsharded training; on a process
  backend, the bytes alive while the trainer was made stay within one unit whole, twice, plus a
  shard (measure/promises.materialized_whole);
* buffers: BatchNorm running statistics and a non-persistent buffer through training with an
  evaluation before every step, against DDP's rule (buffers broadcast from rank 0 before a forward
  that follows a synced training forward, and before the first): a rank that evaluates with its
  own statistics disagrees with DDP;
* CPU offload with gradient accumulation, synced on every micro-batch or on the last only.
"""

from __future__ import annotations

import copy

import pytest
import torch

from shardcheck.conformance.checks.support import compositions as C
from shardcheck.conformance.checks.support.dp_reference import DataParallelReference
from shardcheck.conformance.checks.support.parity import compare_steps, train_in_parity
from shardcheck.conformance.measure import promises
from shardcheck.conformance.measure.memory import MemoryTracker
from shardcheck.conformance.protocol import Clip, Optimizer, Recipe, ShardSpec
from shardcheck.conformance.protocol.capabilities import of_strategy
from shardcheck.harness import distributed

RECIPE = Recipe(loss_fn=C.loss_fn, optimizer=Optimizer("adam", lr=1e-2))  # clipping is its own family's


def _needs(*capabilities):
    return lambda params: {of_strategy(params["strategy"]), *capabilities}


@distributed(world_size=2)
@pytest.mark.requires.with_args(_needs("activation_checkpointing"))
@pytest.mark.parametrize("how", sorted(C.CHECKPOINTING))
@pytest.mark.parametrize("strategy,nesting", [("FULL_SHARD", "flat"), ("FULL_SHARD", "nested"),
                                              ("SHARD_GRAD_OP", "nested")])  # flat adds no case to nested here
def test_activation_checkpointing(ctx, impl, strategy, nesting, how):
    """Each layer checkpointed `how`, its mix and mlp units of their own when `nesting` says so:
    every step equals unsharded training without checkpointing; each step sends, by each collective
    kind, no more than the same engine without checkpointing or the strategy's promise (the larger:
    an engine whose recompute IS its reshard, as SimpleFSDP's, may send FULL_SHARD's twice); and on
    a process backend, forward leaves fewer bytes held for backward than without it."""
    units = C.NESTED if nesting == "nested" else C.FLAT
    plain, model = C.built(ctx, C.LayerNet)
    checkpointed_spec = ShardSpec(strategy=strategy, units=C.units_under(how, units), mesh=ctx.mesh())
    checkpointed = C.train_composed(ctx, impl, plain, C.CHECKPOINTING[how](model), checkpointed_spec, RECIPE, C.batches(ctx),
                                    rename=lambda name: name.replace(C.WRAPPED, ""))
    plain, model = C.built(ctx, C.LayerNet)
    spec = ShardSpec(strategy=strategy, units=units, mesh=ctx.mesh())
    unchecked = C.train_composed(ctx, impl, plain, model, spec, RECIPE, C.batches(ctx))
    C.judge_checkpointed(ctx, how, strategy, (checkpointed, unchecked), C.LayerNet, units, {
        "checkpointed": lambda m, r: impl.trainer(C.CHECKPOINTING[how](m), checkpointed_spec, r),
        "plain": lambda m, r: impl.trainer(m, spec, r)}, RECIPE, C.batches(ctx))


def _values_follow_init(ctx, init: dict, meta_built) -> None:
    """What `reset_parameters` gives, whatever the engine's RNG: tensors that are the same for any
    seed (LayerNorm's ones and zeros) exactly; nn.Linear's draws within its U(-b, b) bound and not
    one value repeated (garbage, zeros and fills are not an init)."""
    with ctx.seeded(1):
        one = dict(C.TiedNet().named_parameters())
    with ctx.seeded(2):
        other = dict(C.TiedNet().named_parameters())
    for name, value in init.items():
        value = value.detach().float().cpu()
        if torch.equal(one[name], other[name]):
            assert torch.equal(value, one[name]), f"{name}: {value.flatten()[:4].tolist()}..., its reset_parameters gives {one[name].flatten()[:4].tolist()}..."
            continue
        bound = C.linear_bound(name, meta_built)
        assert bound is not None, f"{name}: drawn at random by a module the check does not know"
        assert value.abs().max() <= bound and (value.numel() == 1 or value.unique().numel() > 1), (
            f"{name} is not what nn.Linear.reset_parameters draws (U(-{bound:.3f}, {bound:.3f})): "
            f"max |value| {value.abs().max():.3g}, {value.unique().numel()} distinct values")


@distributed(world_size=[2, 4])
@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")  # a rank whose shard of head.weight is empty
@pytest.mark.requires.with_args(_needs("meta_init"))
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_meta_init(ctx, impl, strategy):
    """Built on meta, materialized by the trainer: names (the tied weight once), values on every rank,
    the bytes alive meanwhile, then training equal to unsharded training from those values."""
    _meta_init(ctx, impl, strategy)


@distributed(world_size=4)
@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
@pytest.mark.requires("hybrid_shard", "meta_init")
def test_meta_init_hybrid(ctx, impl):
    """HYBRID_SHARD on a (replicate=2, shard=2) mesh, built on meta: the same, on the replicas too
    (pytorch#178569: buffers garbage on the non-zero replicas)."""
    _meta_init(ctx, impl, "HYBRID_SHARD")


def _meta_init(ctx, impl, strategy):
    with torch.device("meta"):
        meta = C.TiedNet()
    hybrid = strategy == "HYBRID_SHARD"
    mesh = ctx.mesh((2, ctx.world_size // 2), ("replicate", "shard")) if hybrid else ctx.mesh()
    shapes = promises.Shapes.of(meta, ("layer",), ctx.world_size // 2 if hybrid else ctx.world_size)
    spec = ShardSpec(strategy=strategy, units=("layer",), mesh=mesh)
    with ctx.seeded(0), MemoryTracker(ctx.device) as memory:
        trainer = impl.trainer(meta, spec, RECIPE)
        construction = memory.peak
    try:
        init = trainer.full_params()
        plain = C.TiedNet().to(ctx.device)
        assert sorted(init) == sorted(n for n, _ in plain.named_parameters()), (
            f"parameters after meta init {sorted(init)} != the plain model's {sorted(n for n, _ in plain.named_parameters())} "
            f"(decode.weight is embed.weight: one parameter)")
        ctx.assert_equal_across_ranks({n: v.detach().cpu() for n, v in init.items()}, "the materialized parameters")
        _values_follow_init(ctx, init, meta)
        if not ctx.is_threaded:  # bytes per rank need a process per rank
            ctx.record("construction_bytes", construction)
            broken = promises.materialized_whole(construction, shapes)
            assert not broken, broken[0]
        with torch.no_grad():
            for name, p in plain.named_parameters():
                p.copy_(init[name])
        reference = DataParallelReference(plain, spec, RECIPE, ctx.group)
        compare_steps(ctx, trainer, reference, RECIPE, C.batches(ctx, features=C.WIDTH))
    finally:
        if hasattr(trainer, "close"):
            trainer.close()


@distributed(world_size=2)
@pytest.mark.requires.with_args(_needs("compile"))
@pytest.mark.parametrize("strategy", ["FULL_SHARD"])  # a compile costs seconds: the strategy with most hooks
def test_compile(ctx, impl, strategy):
    """Each layer compiled (torch.compile, backend aot_eager) before the engine shards the model:
    every step equals eager unsharded training, and the compiler was handed graphs that apply the
    layers' weights on every rank."""
    if ctx.is_threaded:
        pytest.skip("torch.compile's caches and guards are process-global: the rank threads would share them")
    torch._dynamo.reset()  # a graph compiled by an earlier cell in this rank process is not this cell's
    backend = C.CountingBackend()
    plain, model = C.built(ctx, C.LayerNet)
    spec = ShardSpec(strategy=strategy, units=C.FLAT, mesh=ctx.mesh())
    with C.no_progress_monitor():
        C.train_composed(ctx, impl, plain, C.compiled(model, backend), spec, RECIPE, C.batches(ctx), counted=False)
    backend.verdict(ctx)


@distributed(world_size=4)
@pytest.mark.requires.with_args(lambda params: _needs("tensor_parallel")(params) | (
    {"clip_norm_2"} if params["clip"] == "norm2" else set()))
@pytest.mark.parametrize("clip", ["noclip", "norm2"])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_tensor_parallel(ctx, impl, strategy, clip):
    """Column- and row-parallel linears over a (dp=2, tp=2) mesh's "tp" dimension, the strategy over
    "dp", unclipped or clipped by the 2-norm: every step's loss, full gradients, norm (each element
    counted once across both dimensions) and parameters equal unsharded data-parallel training over
    the dp ranks; parameters are gathered and gradients reduced within the dp groups only, activations
    summed within the tp groups."""
    mesh = ctx.mesh((2, 2), ("dp", "tp"))
    dp, tp = (tuple(sorted(torch.distributed.get_process_group_ranks(mesh[d].get_group()))) for d in ("dp", "tp"))
    spec = ShardSpec(strategy=strategy, units=("layers.0", "layers.1"), mesh=mesh, tensor_parallel=C.TP_PLAN)
    recipe = Recipe(loss_fn=C.loss_fn, optimizer=Optimizer("adam", lr=1e-2), clip=Clip(0.05, 2.0) if clip == "norm2" else None)
    with ctx.seeded(0):
        plain = C.ParallelNet().to(ctx.device)
    reference = DataParallelReference(copy.deepcopy(plain), spec, recipe, mesh["dp"].get_group())
    trainer = C.Counted(impl.trainer(plain, spec, recipe))
    try:
        results = compare_steps(ctx, trainer, reference, recipe, C.batches(ctx, rank=mesh.get_coordinate()[0]))
    finally:
        trainer.close()
    assert clip == "noclip" or results[0].total_norm > 0.05, f"total norm {results[0].total_norm}: the clip did not clip"
    for step, traffic in enumerate(trainer.traffic):
        ctx.record("traffic", {"step": step, **traffic})
    if ctx.is_threaded:  # thread mode's collective tap sees a group's size, not its ranks (measure/traffic.py)
        return
    groups = trainer.groups
    for kind in ("all_gather", "reduce_scatter"):
        assert groups.get(kind, set()) <= {dp}, f"{kind} ran over {sorted(groups.get(kind, set()))}: parameters shard over the dp ranks {dp}"
    assert tp in groups.get("all_reduce", set()), f"no all-reduce over the tp ranks {tp}: activations were not summed"


BUFFERS = Recipe(loss_fn=C.loss_fn, optimizer=Optimizer("adam", lr=1e-2), eval_every=1)


@distributed(world_size=2)
@pytest.mark.requires.with_args(_needs("eval_forward", "buffers"))
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD", "SHARD_OPTIMIZER"])
def test_buffers(ctx, impl, strategy):
    """BatchNorm running statistics (updated by each rank's own batch) and a non-persistent buffer,
    an evaluation before every step: every rank's evaluation loss equals DDP's, whose ranks evaluate
    with rank 0's statistics (broadcast before the forward)."""
    spec = ShardSpec(strategy=strategy, units=("body",), mesh=ctx.mesh())
    train_in_parity(ctx, impl, C.BufferNet, spec, BUFFERS, C.batches(ctx, steps=3))


@distributed(world_size=2)
@pytest.mark.requires.with_args(lambda params: _needs("cpu_offload", "grad_accumulation")(params)
                                | ({"no_sync"} if params["sync"] == "last" else set()))
@pytest.mark.parametrize("sync", ["every", "last"])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_cpu_offload(ctx, impl, strategy, sync):
    """Parameters and gradients offloaded to the CPU, two micro-batches per step, synced on each or
    on the last only (pytorch#73784 broke the latter): every micro-batch's loss and every step's
    gradients, norm and parameters equal unsharded training."""
    recipe = Recipe(loss_fn=C.loss_fn, optimizer=Optimizer("adam", lr=1e-2), accumulation_steps=2,
                    sync_each_micro_batch=sync == "every")
    spec = ShardSpec(strategy=strategy, units=C.FLAT, offload=True, mesh=ctx.mesh())
    train_in_parity(ctx, impl, C.LayerNet, spec, recipe, C.batches(ctx, micro=2))

