"""Unsharded data-parallel training: the yardstick every behaviour check compares a candidate with.

Each rank holds the whole model and its own batch; after backward the gradients are averaged over
the ranks, which is the gradient of the mean of the ranks' losses:

    g = (1/W) * sum_r grad(loss_r)

then the recipe's step runs on the full gradients with torch's own utilities (clip_grad_norm_,
GradScaler, the optimizer). Under mixed precision (param_dtype p, reduce_dtype q) the step is that
of FSDP's MixedPrecision: forward and backward run on a copy of the float32 master parameters cast
to p (floating inputs too), gradients are cast to q, averaged in q, and cast to float32 for the
master step.

It is written apart from protocol/torch_style.py on purpose, although the step reads alike: torch-style
candidates run that one, and a bug shared by the yardstick and the candidate would never show.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn

from conformance.protocol import Recipe, ShardSpec, StepResult


class DataParallelReference:
    """The same interface as a candidate's `Trainer`, computed without sharding."""

    def __init__(self, model: nn.Module, spec: ShardSpec, recipe: Recipe, group=None) -> None:
        self.master, self.recipe, self.group = model, recipe, group
        mp = spec.mixed_precision
        self.compute_dtype = mp.param_dtype if mp and mp.param_dtype else None
        self.reduce_dtype = (mp.reduce_dtype if mp and mp.reduce_dtype else self.compute_dtype)
        self.compute = model
        if self.compute_dtype:  # a low-precision copy; floating inputs are cast to it (as FSDP does)
            self.compute = copy.deepcopy(model).to(self.compute_dtype)
            self.compute.register_forward_pre_hook(lambda _, args: tuple(
                a.to(self.compute_dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in args))
        self.optimizer = recipe.optimizer.build(self.master.parameters())
        self.scaler = None
        if recipe.loss_scale is not None:
            ls = recipe.loss_scale
            self.scaler = torch.amp.GradScaler(spec.device.type, init_scale=ls.init_scale,
                                               growth_factor=ls.growth_factor,
                                               backoff_factor=ls.backoff_factor,
                                               growth_interval=ls.growth_interval)

    def forward_backward(self, batch) -> torch.Tensor:
        if self.compute is not self.master:
            with torch.no_grad():
                for low, p in zip(self.compute.parameters(), self.master.parameters()):
                    low.copy_(p)
        self.compute.zero_grad(set_to_none=True)
        loss = self.recipe.loss_fn(self.compute, batch)
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        size = dist.get_world_size(self.group)
        for low, p in zip(self.compute.parameters(), self.master.parameters()):
            if low.grad is None:
                p.grad = None
                continue
            g = low.grad.to(self.reduce_dtype) if self.reduce_dtype else low.grad
            dist.all_reduce(g, group=self.group)
            p.grad = (g / size).to(p.dtype)
        return loss.detach()

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
        return result

    def full_params(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.master.named_parameters()}
