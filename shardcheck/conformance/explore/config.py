"""One drawn training configuration: plain data (a frozen dataclass), JSON in and out.

The parent draws it (strategies.py), ships it to the ranks as a dict, and every rank builds the same
model, shard spec, recipe and batches from it (model.py). Nothing here imports torch's distributed
packages: a configuration is readable, diffable and replayable (`shardcheck explore --replay FILE`).

The model is a stack of blocks, block i a Linear(widths[i], widths[i + 1]) (tanh between blocks),
optionally with a bias and a buffer added to its output. `tied`: the last block's weight IS the
first block's (widths arranged so the shapes agree). `frozen`: blocks whose parameters do not
require gradients. `units`: {block index: strategy} of the blocks sharded as their own units, the
root sharded with `strategy`. The loop: `accumulation` micro-batches per step (synced on each, or the
last only when not `sync_each`), an evaluation forward every `eval_every` steps.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from shardcheck.strategy import Strategy

DTYPES = ("fp32", "fp16", "bf16")
FORMAT = 1  # the version of the JSON form


@dataclass(frozen=True)
class Poison:
    """An inf or NaN (`value`: "inf" or "nan") added to the gradient of block `block`'s weight on
    rank `rank` at step `step` only (a loss term poison * weight[0, 0])."""

    rank: int
    step: int
    value: str
    block: int


@dataclass(frozen=True)
class Config:
    """A whole training configuration. Floats are plain numbers; math.inf is written "inf" in JSON."""

    world_size: int
    widths: tuple[int, ...]
    bias: tuple[bool, ...]
    buffers: tuple[int, ...] = ()
    frozen: tuple[int, ...] = ()
    tied: bool = False
    strategy: str = Strategy.FULL_SHARD
    units: tuple[tuple[int, str], ...] = ()
    mesh: tuple[int, ...] | None = None  # (replicate, shard) for HYBRID_SHARD
    param_dtype: str = "fp32"
    reduce_dtype: str = "fp32"
    optimizer: str = "adam"
    lr: float = 1e-2
    momentum: float = 0.0
    weight_decay: float = 0.0
    max_norm: float | None = None
    norm_type: float = 2.0
    grad_scale: float = 1.0  # the loss is multiplied by it: gradient magnitudes
    loss_scale: float | None = None  # the initial dynamic loss scale; None: no loss scaling
    growth_interval: int = 2
    poison: Poison | None = None
    steps: int = 2
    batch: int = 3
    data_seed: int = 0
    accumulation: int = 1  # micro-batches per step (Recipe.accumulation_steps)
    sync_each: bool = True  # False: gradients synced on the last micro-batch only (no_sync)
    eval_every: int = 0  # an evaluation forward before every step i with i % eval_every == 0

    @property
    def depth(self) -> int:
        return len(self.widths) - 1

    @property
    def strategies(self) -> set[str]:
        return {self.strategy, *(s for _, s in self.units)}

    def shard_size(self, strategy: str) -> int:
        """The number of ranks one parameter is split over under `strategy`."""
        if strategy in (Strategy.NO_SHARD, Strategy.SHARD_OPTIMIZER):  # parameters whole on every rank
            return 1
        if strategy == Strategy.HYBRID_SHARD and self.mesh:
            return self.mesh[1]
        return self.world_size

    def strategy_of_block(self, i: int) -> str:
        return dict(self.units).get(i, self.strategy)

    def has_empty_shard(self) -> bool:
        """Some rank's shard of some trainable parameter is empty. torch.chunk's split (ceil(n / s)
        rows per rank, the last ranks get what is left) leaves the last rank nothing whenever
        ceil(n / s) * (s - 1) >= n: fewer rows than shards, but also 4 rows over 3 ranks (2, 2, 0)."""
        def empty(rows: int, shards: int) -> bool:
            return -(-rows // shards) * (shards - 1) >= rows
        return any(empty(self.widths[i + 1], self.shard_size(self.strategy_of_block(i)))
                   for i in range(self.depth) if i not in self.frozen)

    def needs_padding(self) -> bool:
        """Some sharded parameter's rows do not split evenly over its shards."""
        return any(self.widths[i + 1] % self.shard_size(self.strategy_of_block(i))
                   for i in range(self.depth))

    def facts(self) -> dict:
        """Named properties a manifest entry's `facts` may test (expectations/manifest.py)."""
        return {
            "world_size": self.world_size,
            "norm_type": "none" if self.max_norm is None else "inf" if math.isinf(self.norm_type)
            else str(int(self.norm_type)),
            "empty_shard": self.has_empty_shard(),
            "padding": self.needs_padding(),
            "strategies": sorted(self.strategies),
            "mixed_strategy": len(self.strategies) > 1,
            "mixed_precision": self.param_dtype != "fp32" or self.reduce_dtype != "fp32",
            "param_dtype": self.param_dtype,
            "reduce_dtype": self.reduce_dtype,
            "loss_scaling": self.loss_scale is not None,
            "poison": self.poison is not None,
            "hybrid_mesh": list(self.mesh) if self.mesh else None,  # (replicate, shard)
            "tied": self.tied,
            "frozen": bool(self.frozen),
            "units": bool(self.units),
            "optimizer": self.optimizer,
            "weight_decay": self.weight_decay > 0,
            "accumulation": self.accumulation > 1,
            "no_sync": self.accumulation > 1 and not self.sync_each,
            "eval": self.eval_every > 0,
        }


def _plain(value):
    """`value` with str subclasses (Strategy, a StrEnum) as plain str, recursively: the dict also
    travels through pytest-xdist's execnet (a finding's summary in the cell's user_properties), which
    serializes builtin types only ("can't serialize <enum 'Strategy'>" ended a --workers run)."""
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_plain(v) for v in value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    return value


def to_json(config: Config) -> dict:
    """A JSON-ready dict of builtin types only (inf as "inf", a strategy as its plain name);
    `from_json` inverts it exactly."""
    out = _plain(asdict(config))
    out["format"] = FORMAT
    if config.norm_type == math.inf:
        out["norm_type"] = "inf"
    return out


def from_json(data: dict) -> Config:
    """The Config of `to_json(config)` (also after a trip through a JSON file)."""
    data = dict(data)
    fmt = data.pop("format", FORMAT)
    if fmt != FORMAT:
        raise ValueError(f"explore configuration format {fmt}; this shardcheck reads {FORMAT}")
    known = {f.name for f in fields(Config)}
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"unknown configuration key(s): {', '.join(sorted(unknown))}")
    if data.get("norm_type") == "inf":
        data["norm_type"] = math.inf
    for key in ("widths", "bias", "buffers", "frozen"):
        if key in data:
            data[key] = tuple(data[key])
    if "units" in data:
        data["units"] = tuple((int(i), s) for i, s in data["units"])
    if data.get("mesh") is not None:
        data["mesh"] = tuple(data["mesh"])
    if data.get("poison") is not None:
        data["poison"] = Poison(**data["poison"])
    return Config(**data)


def dumps(config: Config) -> str:
    return json.dumps(to_json(config), indent=1, sort_keys=True)


def loads(text: str) -> Config:
    return from_json(json.loads(text))
