"""Unsharded data-parallel training: the yardstick every behaviour check compares a candidate with.

Each rank holds the whole model and its own batch; after backward the gradients are averaged over
the ranks, which is the gradient of the mean of the ranks' losses:

    g = (1/W) * sum_r grad(loss_r)

(with a user-set `ShardSpec.gradient_divide_factor` d, ``g = (1/d) * sum_r grad(loss_r)``: the sum
over every rank divided by d once, whatever the candidate's mesh), then the recipe's step runs on
the full gradients with torch's own utilities (clip_grad_norm_, GradScaler, the optimizer). With k micro-batches per step (`recipe.accumulation_steps`) each
micro-batch's loss is divided by k and its averaged gradient added to the step's:

    g = sum_j (1/W) * sum_r grad(loss_rj / k)

whether the candidate syncs every micro-batch or the last only (that changes its communication, not
the result). With a token-weighted loss (`recipe.tokens`: `loss_fn` a sum over the micro-batch's
targets) `begin_step` all-reduces the step's count N of targets and the gradients are summed, not
averaged: ``g = sum_j sum_r grad(loss_rj / N)`` (knobs.OneBatchReference computes the same from one
batch on one device; tests/conformance/test_knob_yardsticks.py holds them to each other). Buffers follow DDP's `broadcast_buffers` rule: before a forward, every buffer takes rank
0's value when the forward before it was a training forward whose gradients were synced (and before
the very first), so BatchNorm's running statistics, updated by each rank's own batch, are rank 0's
whenever the model is evaluated. A parameter no rank gives a gradient (frozen, unused) keeps None; one some
ranks give none in a micro-batch (`recipe.routed`: experts) has zeros there, as DDP with
find_unused_parameters has (`used_anywhere_`), so its gradient is the sum over the ranks that used it / W. `evaluate` is the
loss in eval mode without gradients. Under mixed precision the step is that of FSDP's MixedPrecision,
each module under the policy of the unit holding it (param_dtype p, reduce_dtype q, buffer_dtype b):
forward and backward run on a copy of the float32 master parameters cast to p, buffers in b, each
unit's floating inputs cast to its p in autograd; gradients are cast to q, averaged in q, and cast to
float32 for the master step (with `keep_low_precision_grads`, micro-batches' gradients are summed in q).

It is written apart from protocol/torch_style.py on purpose, although the step reads alike: torch-style
candidates run that one, and a bug shared by the yardstick and the candidate would never show.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_map

from shardcheck.conformance.protocol import Recipe, ShardSpec, StepResult


def all_reduce_coalesced_(tensors, group=None) -> None:
    """``t <- sum over ranks r of t_r`` for every tensor in ``tensors``, in place, in its own dtype.

    One all-reduce per (dtype, device) rather than one per tensor: the tensors are concatenated into
    one flat buffer, summed, and copied back. The sum is elementwise, so this changes the number of
    collectives (each one costs milliseconds when ranks outnumber cores), not the math; only the order
    in which a backend adds more than two ranks' values may differ, as it may between any two backends.
    """
    buckets: dict = {}
    for t in tensors:
        if t is not None:
            buckets.setdefault((t.dtype, t.device), []).append(t)
    for ts in buckets.values():
        flat = torch.cat([t.reshape(-1) for t in ts])
        dist.all_reduce(flat, group=group)
        for t, part in zip(ts, flat.split([t.numel() for t in ts])):
            t.copy_(part.view_as(t))


def predivide_factor(world_size: int) -> int:
    """torch's ``DefaultState`` gradient pre-divide factor ``f``: start at 1, double while
    ``ws % f == 0 and ws / f > f`` (about sqrt(ws): 2 -> 2, 4 -> 2, 8 -> 4). FSDP averages as
    ``(sum_r g_r / f) / (ws / f)``, which decides when a float16 sum overflows.

    shardcheck/reference_impl/collectives.py has its own copy on purpose: this is the yardstick's, and sharing
    a candidate's code would let a bug in it pass unseen.
    """
    factor = 1
    while world_size % factor == 0 and world_size / factor > factor:
        factor *= 2
    return factor


def average_gradients_(grads, group=None, *, predivide: bool = False, factor: float | None = None) -> None:
    """The data-parallel gradient average, in place: ``g <- (1/W) * sum_r g_r`` over the ``W`` ranks
    of ``group``, in each gradient's own dtype (``None`` entries are skipped).

    ``factor`` d (a user-set gradient divide factor, ShardSpec.gradient_divide_factor): ``g <- (1/d) *
    sum_r g_r`` instead, the sum over every rank of ``group`` divided by d once.
    ``predivide``: as torch's FSDP does it, ``(sum_r g_r / f) / (W / f)`` with
    ``f = predivide_factor(W)``, so that a float16 sum overflows exactly when FSDP's does.
    """
    grads = [g for g in grads if g is not None]
    size = dist.get_world_size(group) if factor is None else factor
    pre = predivide_factor(size) if predivide and factor is None else 1
    if pre > 1:
        for g in grads:
            g.div_(pre)
    all_reduce_coalesced_(grads, group)
    for g in grads:
        g.div_(size / pre)


def used_anywhere_(grads, params, dtypes, group=None) -> list:
    """DDP's rule for a parameter some ranks give no gradient (find_unused_parameters: its reducer
    all-reduces the map of locally used parameters): one all-reduce of the ranks' used flags; a
    gradient None here but not on another rank becomes zeros (this rank's contribution to the sum),
    and stays None only where no rank has one (Recipe.routed)."""
    used = torch.tensor([g is not None for g in grads], dtype=torch.int32, device=params[0].device)
    dist.all_reduce(used, group=group)
    return [torch.zeros_like(p, dtype=d or p.dtype) if g is None and u else g
            for g, p, d, u in zip(grads, params, dtypes, used.tolist())]


def broadcast_buffers_(module: nn.Module, group=None) -> None:
    """``b <- b_0`` for every buffer of ``module``: rank 0's value (the group's first rank), in one
    broadcast per dtype, as DDP's `_sync_buffers` does. shardcheck/reference_impl/buffers.py has its
    own copy on purpose, as for `predivide_factor`: the yardstick shares no code with a candidate."""
    buckets: dict = {}
    for b in module.buffers():
        buckets.setdefault((b.dtype, b.device), []).append(b)
    source = dist.get_global_rank(group, 0) if group is not None else 0
    for bs in buckets.values():
        flat = torch.cat([b.reshape(-1) for b in bs])
        dist.broadcast(flat, src=source, group=group)
        with torch.no_grad():
            for b, part in zip(bs, flat.split([b.numel() for b in bs])):
                b.copy_(part.view_as(b))


def reduce_dtype_of(mp) -> torch.dtype | None:
    """The dtype a policy averages gradients in: reduce_dtype, else param_dtype (None: the gradient's own)."""
    return None if mp is None else mp.reduce_dtype or mp.param_dtype


def as_computed(model: nn.Module, spec: ShardSpec, policies: dict) -> nn.Module:
    """The model as mixed precision computes it (`model` itself when no policy casts anything): a
    copy whose parameters are in the param_dtype of the policy of the module holding them (the first
    one, for a parameter two modules share), whose floating buffers are in its buffer_dtype (else
    as built), and whose root and units cast their floating inputs to their param_dtype on entry,
    in autograd (an activation keeps its gradient across the cast)."""
    if not any(mp is not None and (mp.param_dtype or mp.buffer_dtype) for mp in policies.values()):
        return model
    low = copy.deepcopy(model)
    seen = set()
    for path, module in low.named_modules():
        mp = policies[path]
        if mp is None:
            continue
        for p in module._parameters.values():
            if p is not None and p not in seen and mp.param_dtype and p.is_floating_point():
                p.data = p.data.to(mp.param_dtype)
            seen.add(p)
        for name, b in module._buffers.items():
            if b is not None and mp.buffer_dtype and b.is_floating_point():
                module._buffers[name] = b.to(mp.buffer_dtype)
        if mp.param_dtype and (path == "" or spec.is_unit(path, module)):
            module.register_forward_pre_hook(_cast_inputs(mp.param_dtype), with_kwargs=True)
    return low


def _cast_inputs(dtype: torch.dtype):
    def hook(_, args, kwargs):
        return tree_map(lambda a: a.to(dtype) if torch.is_tensor(a) and a.is_floating_point() else a, (args, kwargs))
    return hook


class DataParallelReference:
    """The same interface as a candidate's `Trainer`, computed without sharding."""

    def __init__(self, model: nn.Module, spec: ShardSpec, recipe: Recipe, group=None) -> None:
        self.master, self.recipe, self.group = model, recipe, group
        self.divide_factor = spec.gradient_divide_factor
        policies = spec.policies(model.named_modules())
        self.compute = as_computed(model, spec, policies)
        owner = {}  # parameter -> the policy of the first module holding it
        for path, module in model.named_modules():
            for p in module._parameters.values():
                if p is not None:
                    owner.setdefault(p, policies[path])
        # per parameter: the dtype its gradient is averaged in (None: its own), and summed in
        # over micro-batches under keep_low_precision_grads (None: the master's)
        self.reduce_dtypes = [reduce_dtype_of(owner[p]) for p in model.parameters()]
        self.grad_dtypes = [r if owner[p] is not None and owner[p].keep_low_precision_grads else None
                            for r, p in zip(self.reduce_dtypes, model.parameters())]
        self.optimizer = recipe.optimizer.build(self.master.parameters())
        self.scaler = None
        if recipe.loss_scale is not None:
            ls = recipe.loss_scale
            self.scaler = torch.amp.GradScaler(spec.device.type, init_scale=ls.init_scale,
                                               growth_factor=ls.growth_factor,
                                               backoff_factor=ls.backoff_factor,
                                               growth_interval=ls.growth_interval)

    def _sync_compute(self) -> None:
        """The low-precision copy takes the master values (nothing to do without one)."""
        if self.compute is not self.master:
            with torch.no_grad():
                for low, p in zip(self.compute.parameters(), self.master.parameters()):
                    low.copy_(p)

    def begin_step(self, micro_batches) -> None:
        """A token-weighted loss: the step's count of targets, over every rank's micro-batches."""
        count = torch.zeros((), dtype=torch.float64, device=next(self.master.parameters()).device)
        for batch in micro_batches:
            count += float(self.recipe.tokens(batch))
        dist.all_reduce(count, group=self.group)
        self.tokens = count

    def forward_backward(self, batch) -> torch.Tensor:
        """One micro-batch: its averaged gradient of loss / k added to the step's (`self.summed`); with a
        token-weighted loss, the gradient of loss / N summed over the ranks."""
        self._sync_compute()
        k = self.recipe.accumulation_steps
        self.compute.zero_grad(set_to_none=True)
        self.micro = getattr(self, "micro", 0) + 1
        self._buffers_before_forward(synced=self.recipe.sync_each_micro_batch or self.micro % k == 0)
        loss = self.recipe.loss_fn(self.compute, batch)
        weighted = self.recipe.tokens is not None
        if weighted:
            loss = loss / self.tokens.to(loss.dtype)
        scaled = loss / k if k > 1 and not weighted else loss
        (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
        grads = [None if low.grad is None else low.grad.to(r or low.grad.dtype)
                 for low, r in zip(self.compute.parameters(), self.reduce_dtypes)]
        if self.recipe.routed:
            grads = used_anywhere_(grads, list(self.compute.parameters()), self.reduce_dtypes, self.group)
        average_gradients_(grads, self.group, factor=1.0 if weighted else self.divide_factor)
        summed = getattr(self, "summed", None) or [None] * len(grads)
        self.summed = [s if g is None else g.to(d or p.dtype) if s is None else s + g.to(d or p.dtype)
                       for s, g, p, d in zip(summed, grads, self.master.parameters(), self.grad_dtypes)]
        for g, p in zip(self.summed, self.master.parameters()):
            p.grad = None if g is None else g.to(p.dtype)
        return loss.detach()

    def _buffers_before_forward(self, synced: bool) -> None:
        """DDP's rule (module doc): broadcast if the previous forward was a synced training forward,
        or there was none; `synced` says whether this one is (False for an evaluation)."""
        if getattr(self, "_sync_buffers", True) and next(self.compute.buffers(), None) is not None:
            broadcast_buffers_(self.compute, self.group)
        self._sync_buffers = synced

    def set_requires_grad(self, names, flag: bool) -> None:
        """The schedule's change, on the master parameters and their low-precision copies."""
        for model in {id(m): m for m in (self.master, self.compute)}.values():
            for name in names:
                model.get_parameter(name).requires_grad_(flag)

    def evaluate(self, batch) -> torch.Tensor:
        self._sync_compute()
        self._buffers_before_forward(synced=False)
        self.compute.eval()
        try:
            with torch.no_grad():
                return self.recipe.loss_fn(self.compute, batch).detach()
        finally:
            self.compute.train()

    def full_grads(self) -> dict[str, torch.Tensor | None]:
        inv = 1.0 / self.scaler.get_scale() if self.scaler is not None else 1.0
        return {n: None if p.grad is None else p.grad.detach() * inv for n, p in self.master.named_parameters()}

    def step(self) -> StepResult:
        total = None
        scale_before = self.scaler.get_scale() if self.scaler is not None else None
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        if self.recipe.clip is not None:
            total = float(torch.nn.utils.clip_grad_norm_(self.master.parameters(), self.recipe.clip.max_norm,
                                                         self.recipe.clip.norm_type))
        if self.scaler is None:
            self.optimizer.step()
            result = StepResult(total_norm=total)
        else:
            self.scaler.step(self.optimizer)
            self.scaler.update()
            scale = self.scaler.get_scale()
            result = StepResult(total_norm=total, skipped=scale < scale_before, scale=scale)
        self.optimizer.zero_grad(set_to_none=True)
        self.summed = None
        return result

    def full_params(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.master.named_parameters()}
