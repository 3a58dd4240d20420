"""What a check asks of an implementation: how to shard (`ShardSpec`) and what one training step is
(`Recipe`). Plain data: the adapter maps it onto its own engine."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
import torch.nn as nn

from shardcheck.precision import MixedPrecision as MixedPrecision  # the reference implementation's too
from shardcheck.strategy import Strategy
from shardcheck.conformance.protocol.capabilities import of_strategy


@dataclass(eq=False)
class ShardSpec:
    """How to shard a model. `units` are sub-modules (by class, or dotted path) sharded as their own
    units before the root; `unit_strategies` overrides the strategy per dotted path (mixed strategy).
    `mesh` is 1-D, or 2-D (replicate, shard) for HYBRID_SHARD; the device comes from it.
    `tensor_parallel` (capability `tensor_parallel`): Megatron-style column / row parallel linears
    over the mesh's "tp" dimension, the strategy applied over its "dp" dimension (a 2-D (dp, tp)
    mesh); the full parameters are still the plain model's.
    `gradient_divide_factor` f (capability `gradient_divide_factor`; None: the number of
    data-parallel ranks): the reduced gradient is the sum over every data-parallel rank, replicate
    and shard dimensions of a 2-D mesh together, divided by f (FSDP2's `set_gradient_divide_factor`:
    f = 1 reduces the sum).
    `unit_meshes` (capability `expert_mesh`): {unit path: a 2-D mesh} for units sharded over a mesh of
    their own, as torchtitan shards a mixture of experts' experts (`fully_shard(experts,
    mesh=...)` on its dp_shard_mod_ep dimension) while the dense layers shard over `mesh`: the unit
    shards over the mesh's second dimension and replicates over its first; its gradient is still the
    mean over every data-parallel rank."""

    strategy: str = Strategy.FULL_SHARD  # a Strategy, or its name: FULL_SHARD | SHARD_GRAD_OP | NO_SHARD | ...
    units: tuple[Any, ...] = ()  # module classes and paths
    unit_strategies: dict[str, str] = field(default_factory=dict)
    mixed_precision: MixedPrecision | None = None
    unit_mixed_precision: dict[str, MixedPrecision | None] = field(default_factory=dict)
    offload: bool = False
    mesh: Any = None  # a DeviceMesh
    tensor_parallel: dict[str, str] = field(default_factory=dict)  # {nn.Linear path: "colwise" | "rowwise"}
    gradient_divide_factor: float | None = None
    unit_meshes: dict[str, Any] = field(default_factory=dict)  # {unit path: 2-D (replicate, shard) mesh}

    def __post_init__(self) -> None:
        for strategy in (self.strategy, *self.unit_strategies.values()):
            of_strategy(strategy)  # a typo is an error, not a silently different strategy
        if self.gradient_divide_factor is not None and not self.gradient_divide_factor > 0:
            raise ValueError(f"gradient_divide_factor {self.gradient_divide_factor}: a positive number, or None")
        if Strategy.SHARD_OPTIMIZER in self.strategies and self.strategies != {Strategy.SHARD_OPTIMIZER}:
            raise ValueError("SHARD_OPTIMIZER shards the optimizer of the whole model: not mixed with other "
                             f"strategies ({sorted(self.strategies)})")

    @property
    def device(self) -> torch.device:
        """The device of the ranks' compute: the mesh's device type (cpu without a mesh)."""
        if self.mesh is None:
            return torch.device("cpu")
        kind = self.mesh.device_type
        return torch.device(kind, torch.cuda.current_device()) if kind == "cuda" else torch.device(kind)

    @property
    def dp_mesh(self) -> Any:
        """The mesh the strategy shards over: the "dp" dimension under tensor parallelism, else `mesh`."""
        return self.mesh["dp"] if self.tensor_parallel else self.mesh

    @property
    def strategies(self) -> set[str]:
        return {self.strategy, *self.unit_strategies.values()}

    def is_unit(self, path: str, module: nn.Module) -> bool:
        """Whether the sub-module at `path` is sharded as a unit of its own (the root is not)."""
        return bool(path) and (any(isinstance(u, type) and isinstance(module, u) for u in self.units) or
                               path in self.units or path in self.unit_strategies or path in self.unit_mixed_precision or
                               path in self.unit_meshes)

    def unit_modules(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """The (path, module) pairs that become units, deepest first, root excluded."""
        found = [(path, module) for path, module in model.named_modules() if self.is_unit(path, module)]
        return sorted(found, key=lambda pm: -pm[0].count("."))

    def strategy_of(self, path: str) -> str:
        return self.unit_strategies.get(path, self.strategy)

    def mixed_precision_of(self, path: str) -> MixedPrecision | None:
        """The policy of the unit at `path` ("" for the root): its own, else the root's."""
        return self.unit_mixed_precision.get(path, self.mixed_precision) if path else self.mixed_precision

    def policies(self, named_modules: Iterable[tuple[str, nn.Module]]) -> dict[str, MixedPrecision | None]:
        """{module path: the policy it computes under}: that of the innermost unit holding it, from
        `named_modules` ((path, module) pairs of the model as built, root included)."""
        pairs = list(named_modules)
        units = sorted((p for p, m in pairs if self.is_unit(p, m)), key=len, reverse=True)
        return {path: self.mixed_precision_of(next((u for u in units if path == u or path.startswith(u + ".")), ""))
                for path, _ in pairs}


@dataclass(frozen=True)
class Optimizer:
    """torch's optimizer `kind` ("sgd", "adam" or "adamw") with these hyper-parameters. An engine
    that owns its optimizer must apply exactly this update rule."""

    kind: str = "adam"
    lr: float = 1e-2
    momentum: float = 0.0            # sgd
    betas: tuple[float, float] = (0.9, 0.999)  # adam, adamw
    eps: float = 1e-8                # adam, adamw
    weight_decay: float = 0.0

    def build(self, params: Any) -> torch.optim.Optimizer:
        """The torch optimizer (foreach off: one code path for sharded and unsharded tensors)."""
        return self.torch_class(params=params, **self.torch_kwargs())

    @property
    def torch_class(self) -> type[torch.optim.Optimizer]:
        """torch's optimizer class, for an engine that takes a class and its arguments (torch's
        ZeroRedundancyOptimizer(params, optimizer_class, **kwargs)) rather than an optimizer."""
        return {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[self.kind]

    def torch_kwargs(self) -> dict[str, Any]:
        """The arguments of `torch_class` besides the parameters (foreach off)."""
        if self.kind == "sgd":
            return {"lr": self.lr, "momentum": self.momentum, "weight_decay": self.weight_decay, "foreach": False}
        return {"lr": self.lr, "betas": self.betas, "eps": self.eps, "weight_decay": self.weight_decay,
                "foreach": False}


@dataclass(frozen=True)
class Clip:
    """Scale all gradients by min(1, max_norm / (total_norm + 1e-6)), where total_norm is the
    `norm_type`-norm of every gradient of the model concatenated (the global, unsharded norm)."""

    max_norm: float
    norm_type: float = 2.0

    def __post_init__(self) -> None:
        if self.norm_type not in (1.0, 2.0, math.inf):
            raise ValueError(f"norm_type {self.norm_type}: the checks use 1, 2 or inf")


@dataclass(frozen=True)
class LossScale:
    """Dynamic loss scaling (torch.amp.GradScaler semantics): the loss is multiplied by the scale
    before backward; a step whose gradients hold an inf or NaN on ANY rank is skipped on every rank
    and the scale is multiplied by `backoff_factor`; after `growth_interval` finite steps in a row
    the scale is multiplied by `growth_factor`."""

    init_scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000


@dataclass(frozen=True)
class Recipe:
    """One training step: `loss = loss_fn(model, batch)` (this rank's mean loss), backward, then
    (if `clip`) clip, then the optimizer step (skipped on inf/NaN when `loss_scale`), then zero the
    gradients. The data-parallel loss is the mean of the ranks' losses, so gradients are averaged.

    The loop around the step (the defaults are one micro-batch per step, nothing else):

    * `accumulation_steps` k: `forward_backward` is called k times per step, on micro-batches
      j = 1..k, before `full_grads` and `step`; the step's gradient is the mean over ranks r and
      micro-batches j, ``g = (1/(W k)) sum_r sum_j grad(loss_rj)`` (users divide each micro-batch's
      loss by k before backward; an engine that does so itself, as DeepSpeed does, need not).
    * `sync_each_micro_batch`: False asks the engine to suppress gradient communication on the
      first k-1 micro-batches (FSDP1/DDP `no_sync()`, FSDP2 `set_requires_gradient_sync(False)`)
      and reduce the sum on the last: the same `g`, one reduction per step.
    * `eval_every` n (0: never): an evaluation forward (`model.eval()`, no gradients) on the step's
      first micro-batch before every step i with i % n == 0, so step 0's first forward is one.
    * `frozen`, `unused`, `tied`: facts about the model the trainer is given, named so that an
      engine can refuse them: parameters that arrive with requires_grad=False; parameters the
      loss never uses (no rank gives them a gradient: their gradient stays None and the optimizer
      skips them); (name, alias) pairs where one parameter is held by two modules (listed once,
      under `name`, by named_parameters()).
    * `requires_grad_at`: a fine-tuning schedule, ((step i, parameter names, flag), ...): before
      step i's first forward (its evaluation included) those parameters' requires_grad becomes
      `flag` (`Trainer.set_requires_grad`): a unit frozen for the first steps and then unfrozen,
      or the reverse. `frozen` is the state the trainer is given.

    Knobs of the loop (issue 60; each one a capability, protocol/capabilities.of_loop):

    * `tokens` (capability `token_weighted_loss`): a token-weighted loss over padded micro-batches of
      varying length. `loss_fn` then returns the SUM of the micro-batch's per-token losses and
      `tokens(batch)` the number of target tokens it counts (its non-pad labels); the step's loss is
      the sum over every rank's micro-batches divided by the step's global count
      ``N = sum_r sum_j tokens(batch_rj)``, agreed across the data-parallel ranks before the first
      backward (`Trainer.begin_step`): ``g = (1/N) sum_r sum_j grad(loss_rj)``, what one device
      computes from the same tokens in one batch, whatever the ranks, micro-batches and padding.
      Per-micro-batch means averaged are not this (transformers' Trainer before 4.46).
      `forward_backward` returns the micro-batch's share ``loss_rj / N``.
    * `reshard_after_backward`: False keeps the parameters unsharded after the backward of every
      micro-batch but a step's last (FSDP2's `set_reshard_after_backward(False)`), so that the
      later micro-batches gather nothing; the last one reshards (capability `reshard_after_backward`).
    * `mark_last_backward`: the trainer tells the engine which backward is a step's last (FSDP2's
      `set_is_last_backward(j == k)`): the engine finalizes its backward state then only, and
      still reduces every backward whose gradient sync is on (capability `is_last_backward`).
    * `routed` (capability `idle_experts`): parameters a router feeds on some ranks only (a mixture
      of experts' experts): in a step an expert may get tokens on some ranks and none on others, or
      none on any. Its gradient is that of unsharded data-parallel training, as DDP with
      `find_unused_parameters=True` computes it: the sum over the ranks that used it divided by the
      world size W (a rank that routed no token to it contributes zero), on EVERY rank; None only in
      a step where no rank used it, and then the optimizer skips it (torch's optimizers skip a None
      gradient: AdamW neither decays it nor advances its moments; a zero gradient would do both)."""

    loss_fn: Callable[[nn.Module, Any], torch.Tensor]
    optimizer: Optimizer = Optimizer()
    clip: Clip | None = None
    loss_scale: LossScale | None = None
    accumulation_steps: int = 1
    sync_each_micro_batch: bool = True
    eval_every: int = 0
    frozen: tuple[str, ...] = ()
    unused: tuple[str, ...] = ()
    tied: tuple[tuple[str, str], ...] = ()
    requires_grad_at: tuple[tuple[int, tuple[str, ...], bool], ...] = ()
    tokens: Callable[[Any], Any] | None = None
    reshard_after_backward: bool = True
    mark_last_backward: bool = False
    routed: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.accumulation_steps < 1 or self.eval_every < 0:
            raise ValueError(f"accumulation_steps {self.accumulation_steps} < 1 or eval_every {self.eval_every} < 0")

    def micro_batches(self, batch: Any) -> list[Any]:
        """The micro-batches of one step: `batch` itself, or the k items of it when k > 1."""
        if self.accumulation_steps == 1:
            return [batch]
        assert len(batch) == self.accumulation_steps, f"{len(batch)} micro-batches, recipe says {self.accumulation_steps}"
        return list(batch)

    def evaluates_before(self, step: int) -> bool:
        return bool(self.eval_every) and step % self.eval_every == 0

    def requires_grad_before(self, step: int) -> list[tuple[tuple[str, ...], bool]]:
        """The (parameter names, flag) changes the schedule makes before `step`."""
        return [(names, flag) for at, names, flag in self.requires_grad_at if at == step]
