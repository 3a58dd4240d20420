"""Hypothesis strategies that draw a whole training configuration (config.Config), limited by what
an implementation declares (shardcheck/conformance/protocol/capabilities.py): a strategy, norm type, loss
scaling or low-precision dtype the adapter lacks is never drawn (so never counted as a pass); per-unit
strategies need `mixed_strategy`, units `nested_units`, frozen parameters `orig_params`.

Values are listed simplest first, so hypothesis shrinks a failure towards world size 1, one block,
width 1, FULL_SHARD, float32, no clipping, no loss scaling, one step.
"""

from __future__ import annotations

import math

from hypothesis import strategies as st

from shardcheck.strategy import Strategy
from shardcheck.conformance.explore.config import Config, Poison
from shardcheck.conformance.protocol.capabilities import STRATEGIES, of_norm, of_strategy

MAX_DEPTH = 4
MAX_WIDTH = 9  # 1 .. 9: width 1, primes, sizes below and above every world size drawn
NORM_TYPES = (2.0, 1.0, math.inf)
OPTIMIZERS = ("sgd", "adam", "adamw")


def meshes(world_size: int) -> list[tuple[int, int]]:
    """Every (replicate, shard) factorisation of `world_size`, the 1-D-like (1, ws) first."""
    return sorted(((world_size // s, s) for s in range(1, world_size + 1) if world_size % s == 0),
                  key=lambda m: m[0])


def declared_strategies(capabilities) -> list[str]:
    return [s for s in STRATEGIES if of_strategy(s) in capabilities]


def low_dtypes(capabilities) -> list[str]:
    return [d for d in ("bf16", "fp16") if f"mixed_precision_{d}" in capabilities]


def subset(draw, items) -> tuple[int, ...]:
    """A sorted sub-tuple of `items` (shrinks towards the empty one)."""
    return tuple(i for i in items if draw(st.booleans()))


@st.composite
def model_shape(draw, capabilities) -> dict:
    """Depth, widths (1 .. MAX_WIDTH, small ones favoured: empty and padded shards), biases,
    buffers, tying, frozen blocks."""
    depth = draw(st.integers(1, MAX_DEPTH))
    width = st.one_of(st.integers(1, 4), st.integers(1, MAX_WIDTH))  # half the draws at most 4 wide
    widths = [draw(width) for _ in range(depth + 1)]
    tied = depth >= 2 and draw(st.booleans())
    if tied:  # the last block's weight is the first's: same shape
        widths[depth - 1] = widths[0]
        widths[depth] = widths[1]
    bias = tuple(draw(st.booleans()) for _ in range(depth))
    buffers = subset(draw, range(depth))
    frozen = subset(draw, range(depth)) if "orig_params" in capabilities else ()
    if len(frozen) == depth or (tied and {0, depth - 1} & set(frozen)):
        frozen = ()  # something must train; a tied weight is trained by both blocks
    return dict(widths=tuple(widths), bias=bias, buffers=buffers, frozen=frozen, tied=tied)


@st.composite
def sharding(draw, capabilities, world_size: int, depth: int, tied: bool) -> dict:
    """The root strategy (a 2-D mesh for HYBRID_SHARD), the blocks sharded as their own units, and
    a strategy per unit when the implementation mixes strategies."""
    strategies = declared_strategies(capabilities)
    strategy = draw(st.sampled_from(strategies))
    mesh = draw(st.sampled_from(meshes(world_size))) if strategy == Strategy.HYBRID_SHARD else None
    units: tuple = ()
    if "nested_units" in capabilities:
        candidates = [i for i in range(depth) if not (tied and i in (0, depth - 1))]
        flat = [s for s in strategies if s not in (Strategy.HYBRID_SHARD, Strategy.SHARD_OPTIMIZER)]  # whole-model strategies
        mixed = "mixed_strategy" in capabilities and strategy not in (Strategy.HYBRID_SHARD, Strategy.SHARD_OPTIMIZER)
        units = tuple((i, draw(st.sampled_from(flat)) if mixed else strategy)
                      for i in subset(draw, candidates))
    return dict(strategy=strategy, mesh=mesh, units=units)


@st.composite
def precision(draw, capabilities, world_size: int) -> dict:
    """Compute (param) and reduce dtypes among fp32 and the declared low-precision ones. A
    low-precision reduce only at world sizes 1 and 2: a sum of more ranks' values rounds differently
    in each order of addition (reduce-scatter vs the reference's all-reduce), beyond one dtype
    tolerance, and the oracle has no say in the order."""
    dtypes = ["fp32", *low_dtypes(capabilities)]
    return dict(param_dtype=draw(st.sampled_from(dtypes)),
                reduce_dtype=draw(st.sampled_from(dtypes if world_size <= 2 else ["fp32"])))


@st.composite
def optimizer(draw) -> dict:
    kind = draw(st.sampled_from(OPTIMIZERS))
    return dict(optimizer=kind, lr=draw(st.sampled_from((1e-2, 1e-1, 1e-3))),
                momentum=draw(st.sampled_from((0.0, 0.9))) if kind == "sgd" else 0.0,
                weight_decay=draw(st.sampled_from((0.0, 0.01))))


@st.composite
def clipping(draw, capabilities) -> dict:
    """No clip, or a max_norm over six orders of magnitude with a declared norm type (drawn as one
    choice among "none" and the norm types, so that clipping is drawn most of the time)."""
    norm = draw(st.sampled_from([None, *(n for n in NORM_TYPES if of_norm(n) in capabilities)]))
    if norm is None:
        return dict(max_norm=None)
    return dict(max_norm=10.0 ** draw(st.integers(-3, 3)), norm_type=norm)


@st.composite
def scaling(draw, capabilities, world_size: int, steps: int, trainable: list[int]) -> dict:
    """Dynamic loss scaling (initial scale 2**0 .. 2**16, growth interval 1 .. 3), and an inf or NaN
    on one rank at one step in one trainable block's gradient. Not with a float16 reduce: whether
    a scaled gradient's sum overflows there depends on pre-division (see `magnitude`)."""
    if "loss_scaling" not in capabilities or not draw(st.booleans()):
        return dict(loss_scale=None)
    out = dict(loss_scale=2.0 ** draw(st.integers(0, 16)), growth_interval=draw(st.integers(1, 3)))
    if draw(st.booleans()):
        out["poison"] = Poison(rank=draw(st.integers(0, world_size - 1)), step=draw(st.integers(0, steps - 1)),
                               value=draw(st.sampled_from(("inf", "nan"))), block=draw(st.sampled_from(trainable)))
    return out


def magnitude(precision: dict):
    """The loss multiplier (gradient magnitude), 10**k. With a float16/bfloat16 compute dtype and a
    float32 reduce, k reaches 6: gradients that overflow float16 in backward, identically on both
    sides. Otherwise |k| <= 2: a large multiplier magnifies rounding differences (the order of a sum
    across ranks) past the float32 tolerance, and a low-precision reduce near overflow depends on
    whether the implementation pre-divides before the sum (FSDP does, the unsharded reference does
    not): implementation-defined, not a sharding bug."""
    low_compute = precision["param_dtype"] != "fp32" and precision["reduce_dtype"] == "fp32"
    return st.integers(-2, 6 if low_compute else 2).map(lambda k: 10.0 ** k)


@st.composite
def loop(draw, capabilities, precision: dict) -> dict:
    """The loop around the step, where declared: 1 to 3 micro-batches per step, synced on each or on
    the last only, an evaluation forward every 1 or 2 steps. Nothing is drawn for an implementation
    without these capabilities, so its examples stay as they were. Accumulation in float32 only:
    with a low-precision dtype the sum over micro-batches rounds wherever an engine keeps it (the
    held sum's dtype, a loss scaler's exponent), implementation-defined like the order of a sum
    across ranks; the training_loop family judges mixed precision with a float32 reduction."""
    out = {}
    if "grad_accumulation" in capabilities and precision == {"param_dtype": "fp32", "reduce_dtype": "fp32"}:
        out["accumulation"] = draw(st.integers(1, 3))
        if out["accumulation"] > 1 and "no_sync" in capabilities:
            out["sync_each"] = draw(st.booleans())
    if "eval_forward" in capabilities:
        out["eval_every"] = draw(st.sampled_from((0, 1, 2)))
    return out


@st.composite
def configs(draw, capabilities, world_sizes=(1, 2, 3, 4)) -> Config:
    """A whole training configuration an implementation with `capabilities` declares it can run,
    on one of `world_sizes` ranks."""
    capabilities = frozenset(capabilities)
    world_size = draw(st.sampled_from(sorted(world_sizes)))
    shape = draw(model_shape(capabilities))
    depth = len(shape["widths"]) - 1
    steps = draw(st.integers(1, 4))
    trainable = [i for i in range(depth) if i not in shape["frozen"]]
    dtypes = draw(precision(capabilities, world_size))
    return Config(
        world_size=world_size, **shape,
        **draw(sharding(capabilities, world_size, depth, shape["tied"])),
        **dtypes, **draw(optimizer()), **draw(clipping(capabilities)),
        grad_scale=draw(magnitude(dtypes)),
        **(draw(scaling(capabilities, world_size, steps, trainable)) if dtypes["reduce_dtype"] != "fp16" else {}),
        steps=steps, data_seed=draw(st.integers(0, 3)), **draw(loop(capabilities, dtypes)))
