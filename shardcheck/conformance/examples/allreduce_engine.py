"""A worked example of an adapter for an engine that owns its training step (docs/adapters.md).

`AllReduceEngine` stands for any third-party trainer: it wraps the model and the optimizer, has its
own `backward` (which all-reduces gradients), clips inside `step` by a configured L2 norm, and keeps
its parameters replicated. The adapter below maps a shardcheck `Recipe` onto it, in ~40 lines.

    shardcheck run --impl shardcheck.conformance.examples.allreduce_engine:AllReduceAdapter --family train_parity
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardcheck.conformance.protocol import StepResult, Unsupported


class AllReduceEngine:
    """The 'engine': replicated parameters, averaged gradients, L2 clipping inside step()."""

    def __init__(self, model, optimizer, max_grad_norm=None, group=None):
        self.module, self.optimizer, self.max_grad_norm, self.group = model, optimizer, max_grad_norm, group
        self.last_norm = None

    def __call__(self, *args):
        return self.module(*args)

    def backward(self, loss):
        loss.backward()
        for p in self.module.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=self.group)
                p.grad /= dist.get_world_size(self.group)

    def step(self):
        if self.max_grad_norm is not None:
            self.last_norm = float(torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.max_grad_norm))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


class AllReduceTrainer:
    def __init__(self, model, spec, recipe):
        self.recipe = recipe
        self.engine = AllReduceEngine(model, recipe.optimizer.build(model.parameters()),
                                      recipe.clip.max_norm if recipe.clip else None, spec.mesh.get_group())

    def forward_backward(self, batch):
        loss = self.recipe.loss_fn(self.engine, batch)
        self.engine.backward(loss)
        return loss.detach()

    def full_grads(self):
        return {n: None if p.grad is None else p.grad.clone() for n, p in self.engine.module.named_parameters()}

    def step(self):
        self.engine.step()
        return StepResult(total_norm=self.engine.last_norm)

    def full_params(self):
        return {n: p.detach().clone() for n, p in self.engine.module.named_parameters()}


class AllReduceAdapter:
    name = "allreduce-example"
    version = "1.0"
    capabilities = frozenset({"no_shard", "clip_norm_2"})  # replicated only; L2 clipping only

    def trainer(self, model, spec, recipe):
        if spec.strategies != {"NO_SHARD"} or spec.mixed_precision or recipe.loss_scale:
            raise Unsupported("the example engine only replicates, in float32, without loss scaling")
        return AllReduceTrainer(model, spec, recipe)
