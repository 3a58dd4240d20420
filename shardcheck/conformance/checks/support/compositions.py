"""What the composition family trains, and how: a transformer-shaped model, the ways users wrap it
before handing it to an engine (activation checkpointing three ways, built on meta), and a parity
run that also counts the candidate's collectives per step.

`LayerNet` is ``head(block_1(block_0(tanh(embed(x)))))`` where each `Layer` is a transformer
layer's shape, ``h = x + tanh(mix(norm(x))); out = h + mlp(h)``: a norm, a token mixer and an MLP.
Its units nest as llama's do under FSDP: each layer is a unit, and (NESTED) its `mix` and `mlp` are
units of their own inside it, the layer's unit owning only the norm.

`BufferNet` adds what training keeps besides parameters: a BatchNorm1d (running mean, variance and
count, updated by every training forward from this rank's batch) and a non-persistent buffer
(`Frequencies.table`, RoPE's inverse frequencies: computed, never saved, re-made by
`reset_parameters` after `to_empty`). `TiedNet` ties its output projection to its input projection
(one parameter, two modules), for meta-device init.
"""

from __future__ import annotations

import contextlib
import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from shardcheck.conformance.checks.support.dp_reference import DataParallelReference
from shardcheck.conformance.checks.support.parity import compare_steps
from shardcheck.conformance.measure import footprint, promises
from shardcheck.conformance.measure.traffic import CollectiveCounter
from shardcheck.conformance.measure.footprint import traffic_table

WIDTH, STEPS = 8, 2
WRAPPED = "_checkpoint_wrapped_module."  # the name checkpoint_wrapper puts between a layer and its own


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.mix = nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 12), nn.Tanh(), nn.Linear(12, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + torch.tanh(self.mix(self.norm(x)))
        return h + self.mlp(h)


class LayerNet(nn.Module):
    """`checkpointed`: the model's own forward checkpoints each layer (torch.utils.checkpoint,
    non-reentrant), as a user's model code does."""

    def __init__(self, checkpointed: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(6, WIDTH)
        self.layers = nn.ModuleList(Layer() for _ in range(2))
        self.head = nn.Linear(WIDTH, 1)
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        for layer in self.layers:
            h = checkpoint(layer, h, use_reentrant=False) if self.checkpointed else layer(h)
        return self.head(h)


FLAT = ("layers.0", "layers.1")
NESTED = (*FLAT, "layers.0.mix", "layers.0.mlp", "layers.1.mix", "layers.1.mlp")


def _utils(model: LayerNet) -> LayerNet:
    model.checkpointed = True
    return model


def _wrapper(model: LayerNet) -> LayerNet:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    for i, layer in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    return model


def _composable(model: LayerNet) -> LayerNet:
    from torch.distributed._composable import checkpoint as composable_checkpoint

    for layer in model.layers:
        composable_checkpoint(layer)
    return model


CHECKPOINTING = {  # how users apply activation checkpointing to each layer, before sharding
    "utils": _utils,             # torch.utils.checkpoint.checkpoint(layer, h) in the model's forward
    "wrapper": _wrapper,         # checkpoint_wrapper(layer): a module around the layer (names gain a prefix)
    "composable": _composable,   # torch.distributed._composable.checkpoint(layer): hooks, names unchanged
}


class CountingBackend:
    """torch.compile's `aot_eager` backend, counting the graphs it was handed and, in them, the ops
    that apply a layer's weights (`WEIGHTED`): a compiled cell whose model never reached the compiler
    judged eager training, and so did one whose compiler got only the fragments around the layers'
    projections (norms, rotary embeddings, activations: what dynamo still traces in helper functions
    after it fell back to eager for the layer itself, as under FSDP1's flat parameters, F51). The ops
    are counted in each graph and in the bodies of its higher-order ops: an autograd.Function that
    applies the weight (DeepSpeed ZeRO-3's linear, `input.matmul(weight.t())`) is traced as one."""

    WEIGHTED = frozenset({"linear", "addmm", "conv1d", "conv2d"})

    def __init__(self) -> None:
        self.graphs = self.weighted = 0

    def __call__(self, graph, example_inputs):
        self.graphs += 1
        self.weighted += sum(self.applies_weight(n) for body in graph.modules()
                             if isinstance(body, torch.fx.GraphModule) for n in body.graph.nodes)
        return torch._dynamo.lookup_backend("aot_eager")(graph, example_inputs)

    @classmethod
    def applies_weight(cls, node) -> bool:
        """A node of `WEIGHTED`, or a product with a 2-D matrix (`x.matmul(weight.t())`, DeepSpeed ZeRO-3's
        linear): attention's products are of 4-D activations."""
        if node.op not in ("call_function", "call_method"):
            return False
        name = getattr(node.target, "__name__", node.target)
        if name in cls.WEIGHTED:
            return True
        return name in ("matmul", "mm") and any(
            getattr(arg.meta.get("example_value"), "ndim", None) == 2 for arg in node.args if isinstance(arg, torch.fx.Node))

    def verdict(self, ctx, what: str = "the layers") -> None:
        """Record the counts; fail when `what` ran eagerly."""
        ctx.record("compiled_graphs", self.graphs)
        ctx.record("compiled_weighted_ops", self.weighted)
        assert self.graphs > 0, f"torch.compile was never handed a graph: {what} ran eagerly"
        assert self.weighted > 0, (
            f"torch.compile was handed {self.graphs} graph(s), none with a layer's weights ({', '.join(sorted(self.WEIGHTED))} or a product with a matrix): "
            f"{what} ran eagerly around compiled fragments")


@contextlib.contextmanager
def no_progress_monitor():
    """torch.fx's interpreter (what aot_eager runs) makes a tqdm bar per graph run, disabled, but
    tqdm starts its monitor thread in `__new__` whatever: a daemon that outlives the cell, which the
    harness refuses (a thread left running). With tqdm installed, its monitor is off meanwhile."""
    try:
        from tqdm import tqdm
    except ImportError:
        yield
        return
    interval, tqdm.monitor_interval = tqdm.monitor_interval, 0
    try:
        yield
    finally:
        tqdm.monitor_interval = interval


def compiled(model: nn.Module, backend, layers: str = "layers") -> nn.Module:
    """Each layer of the list at `layers` compiled in place (`nn.Module.compile`), as FSDP users
    compile per transformer block; the engine shards the model afterwards."""
    for layer in model.get_submodule(layers):
        layer.compile(backend=backend)
    return model


def units_under(how: str, units: tuple[str, ...]) -> tuple[str, ...]:
    """The unit paths once `how` has wrapped the layers (checkpoint_wrapper moves each layer's
    modules under `_checkpoint_wrapped_module`); the unit is the layer, inside the wrapper, as in
    torch's own tests."""
    if how != "wrapper":
        return units
    return tuple(f"layers.{p.split('.')[1]}.{WRAPPED}{'.'.join(p.split('.')[2:])}".rstrip(".") for p in units)


class Frequencies(nn.Module):
    """RoPE-like inverse frequencies: a non-persistent buffer, a pure function of the width."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.empty(WIDTH), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.table.copy_(1.0 / (100.0 ** (torch.arange(WIDTH, device=self.table.device) / WIDTH)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.cos(self.table)


class BufferNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, WIDTH)
        self.freq = Frequencies()
        self.body = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH), nn.Tanh())
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.freq(torch.tanh(self.embed(x)))))


class TiedNet(nn.Module):
    """`decode.weight` IS `embed.weight`; `freq.table` is non-persistent; `layer` is a unit."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(WIDTH, WIDTH)
        self.freq = Frequencies()
        self.layer = Layer()
        self.decode = nn.Linear(WIDTH, WIDTH)
        self.decode.weight = self.embed.weight
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.freq(torch.tanh(self.embed(x)))
        return self.head(torch.tanh(self.decode(self.layer(h))))


class Parallel(nn.Module):
    """A transformer MLP cut for tensor parallelism: `up` column-parallel, `down` row-parallel."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 16)
        self.down = nn.Linear(16, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class ParallelNet(nn.Module):
    """`embed` and `head` replicated over the TP group, two `Parallel` layers sliced (TP_PLAN)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, WIDTH)
        self.layers = nn.ModuleList(Parallel() for _ in range(2))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


TP_PLAN = {f"layers.{i}.{name}": style for i in range(2) for name, style in (("up", "colwise"), ("down", "rowwise"))}


def loss_fn(model, batch) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x).float(), y)


def batches(ctx, features: int = 6, steps: int = STEPS, micro: int = 1, rank: int | None = None) -> list:
    """Per step one (x, y) of 4 rows, or `micro` of them; different per rank (`rank`: the data-parallel
    rank, when the ranks of a tensor-parallel group must see one batch)."""
    rank = ctx.rank if rank is None else rank
    out = []
    for step in range(steps):
        got = []
        for j in range(micro):
            with ctx.seeded(1000 * step + 100 * j + rank):
                got.append((torch.randn(4, features, device=ctx.device), torch.randn(4, 1, device=ctx.device)))
        out.append(got if micro > 1 else got[0])
    return out


def linear_bound(name: str, model: nn.Module) -> float | None:
    """nn.Linear.reset_parameters draws weight and bias from U(-b, b), b = 1/sqrt(in_features);
    None for a parameter of another module."""
    module = model.get_submodule(name.rsplit(".", 1)[0])
    return 1.0 / math.sqrt(module.in_features) if isinstance(module, nn.Linear) else None


class Counted:
    """A candidate's trainer whose `forward_backward` and `step` run under a `CollectiveCounter`:
    `traffic[i]` is step i's table (footprint.traffic_table), `groups` the groups each kind ran over;
    `rename` maps the engine's parameter names to the plain model's."""

    def __init__(self, trainer, rename=lambda name: name, counting: bool = True) -> None:
        self.trainer, self.rename, self.traffic, self._counter = trainer, rename, [], None
        self.counting = counting
        self.groups: dict[str, set] = {}  # kind -> the groups (global ranks) it ran over

    def _count(self, call, *args):
        if not self.counting:
            return call(*args)
        if self._counter is None:
            self._counter = CollectiveCounter()
        with self._counter:
            return call(*args)

    def forward_backward(self, batch):
        return self._count(self.trainer.forward_backward, batch)

    def step(self):
        result = self._count(self.trainer.step)
        if self.counting:
            self.traffic.append(traffic_table(self._counter))
            for call in self._counter.calls:
                self.groups.setdefault(call.kind, set()).add(tuple(sorted(call.ranks or ())))
        self._counter = None
        return result

    def evaluate(self, batch):
        return self.trainer.evaluate(batch)

    def full_grads(self):
        return {self.rename(n): g for n, g in self.trainer.full_grads().items()}

    def full_params(self):
        return {self.rename(n): p for n, p in self.trainer.full_params().items()}

    def close(self) -> None:
        if hasattr(self.trainer, "close"):
            self.trainer.close()


def train_composed(ctx, impl, plain: nn.Module, model: nn.Module, spec, recipe, batches: list,
                   rename=lambda name: name, counted: bool = True) -> list[dict]:
    """Train `model` (what the user composed from `plain`) with the candidate's trainer and `plain`
    with unsharded data-parallel training, compared after every step (parity.compare_steps); return
    the candidate's collectives of each step (none when not `counted`: torch.compile does not
    compile under the counter's dispatch mode)."""
    reference = DataParallelReference(plain, spec, recipe, ctx.group)
    trainer = Counted(impl.trainer(model, spec, recipe), rename, counting=counted)
    try:
        compare_steps(ctx, trainer, reference, recipe, batches)
        return trainer.traffic
    finally:
        trainer.close()


def built(ctx, build) -> tuple[nn.Module, nn.Module]:
    """The model built the plain way (seed 0) twice: one for the candidate, one for the yardstick."""
    with ctx.seeded(0):
        plain = build().to(ctx.device)
    return plain, copy.deepcopy(plain)


def sent_by_kind(traffic: dict) -> dict:
    """{kind: bytes this rank sent} of one step's traffic table."""
    return {kind: row["sent"] for kind, row in sorted(traffic.items())}


def judge_checkpointed(ctx, how: str, strategy: str, traffic: tuple[list[dict], list[dict]], build, units,
                       trainers: dict, recipe, batches: list, model: str = "") -> None:
    """The family's verdict on activation checkpointing applied `how` to a `strategy` engine
    (test_composition.py, test_models_composed.py). `traffic`: the candidate's collectives of each
    step with checkpointing and without (train_composed); each step must send, by each collective
    kind, no more than without checkpointing or the strategy's promise for `build()`'s shapes in
    `units` (the larger: an engine whose recompute IS its reshard, as SimpleFSDP's, may send
    FULL_SHARD's twice; recompute must not gather a unit again). Then, on a process backend, forward
    must leave fewer bytes held for backward (footprint.measure) with `trainers["checkpointed"]`
    than with `trainers["plain"]` (each `(model, recipe) -> Trainer`). `model` names the model in
    the messages."""
    checkpointed, unchecked = traffic
    shapes = promises.Shapes.of(build(), units, ctx.world_size)
    promised = promises.sent_formulas(strategy, shapes.shard_bytes * ctx.world_size, ctx.world_size, 1)
    subject = f"{model}: " if model else ""
    for step, (got, want) in enumerate(zip(checkpointed, unchecked)):
        sent, unsent = sent_by_kind(got), sent_by_kind(want)
        ctx.record("traffic", {"step": step, "checkpointed": sent, "plain": unsent, "promised": promised})
        for kind in sorted(set(got) | set(want)):
            allowed = max(unsent.get(kind, 0.0), promised.get(kind, 0.0))
            assert sent.get(kind, 0.0) <= allowed, (
                f"step {step}: {subject}with activation checkpointing ({how}) this rank sends {sent.get(kind, 0.0):.0f} B "
                f"by {kind} ({got[kind]['calls']} calls), without it {unsent.get(kind, 0.0):.0f} B; {strategy} "
                f"promises {promised.get(kind, 0.0):.0f} B: recomputing forward gathered again")
    assert "all_gather" in checkpointed[-1], "no all-gather counted in a sharded step: the counter saw nothing"
    if ctx.is_threaded:  # bytes per rank need a process per rank
        return
    held = {label: footprint.measure(ctx, build, trainers[label], recipe, batches)["forward"]
            for label in ("checkpointed", "plain")}
    ctx.record("held_after_forward", held)
    assert held["checkpointed"] < held["plain"], (
        f"{subject}with activation checkpointing ({how}) forward leaves {held['checkpointed']} B held on this rank, "
        f"without it {held['plain']} B: checkpointing must save less for backward")
