"""F75: under DeepSpeed's `torch_autocast` (bfloat16), a ZeRO-3 engine gives a tied weight (one
parameter used by two Linears) the float32 sum of its per-use bfloat16 gradients, where torch.autocast
itself sums the uses in bfloat16: ZeRO-3 replaces torch.nn.functional.linear with
LinearFunctionForZeroStage3 (deepspeed/runtime/zero/linear.py, zero.Init's documented
`mem_efficient_linear`), whose backward returns each use's bf16 grad_weight; autograd casts each to
the float32 parameter's dtype and accumulates in float32. torch.autocast's own F.linear casts the
weight once (a cached bf16 copy) and accumulates both uses' gradients on that bf16 copy before its one
cast back. Untied (two parameters with the same values) the engine matches torch.autocast exactly.

Each rank: the engine's averaged gradient (safe_get_full_grad, float32 reduction) against torch.autocast
training of a copy, all-reduced in float32 by hand."""

import copy
import functools
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from _launch import run, verdict


class Tied(nn.Module):
    def __init__(self, tied: bool):
        super().__init__()
        self.a, self.b = nn.Linear(6, 6, bias=False), nn.Linear(6, 6, bias=False)
        if tied:
            self.b.weight = self.a.weight
        else:
            self.b.weight.data.copy_(self.a.weight.data)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def body(tied, rank, world_size):
    os.environ.update(DS_ACCELERATOR="cpu", LOCAL_RANK=str(rank))
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    torch.manual_seed(0)
    model = Tied(tied)
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    # the reference first: a ZeRO-3 engine replaces F.linear for the whole process (F31)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = reference(x)
    (F.mse_loss(out.float(), y) * 1000).backward()
    config = {"train_batch_size": world_size, "train_micro_batch_size_per_gpu": 1,
              "zero_allow_untested_optimizer": True, "zero_optimization": {"stage": 3},
              # float32 reduction (no module's gradients reduced in bf16), as the reference's
              "torch_autocast": {"enabled": True, "dtype": "bfloat16", "lower_precision_safe_modules": []}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
                                      config=config)
    engine.backward(F.mse_loss(engine(x).float(), y) * 1000)
    got = {n: safe_get_full_grad(p).float() for n, p in engine.module.named_parameters()}
    worst = 0.0
    for n, p in reference.named_parameters():
        dist.all_reduce(p.grad)
        p.grad /= world_size
        worst = max(worst, (got[n] - p.grad).abs().max().item())
    engine.destroy()
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses
    F.linear = getattr(InsertPostInitMethodToModuleSubClasses, "linear_bk", F.linear)  # F31: put it back
    return f"{'tied' if tied else 'untied'}: max |engine - torch.autocast| gradient {worst:.4g}"


if __name__ == "__main__":
    results = {}
    for tied in (True, False):
        for rank, result in run(functools.partial(body, tied), world_size=2, timeout_s=120).items():
            results[f"{rank} {'tied' if tied else 'untied'}"] = result
    diffs = {k: float(v.rsplit(" ", 1)[1]) if v.startswith("returned") else None for k, v in results.items()}
    verdict(all(d is not None for d in diffs.values())
            and all(d > 0 for k, d in diffs.items() if k.endswith(" tied"))
            and all(d < 1e-6 for k, d in diffs.items() if k.endswith("untied")),
            "ZeRO-3 under torch_autocast: a tied weight's gradient differs from torch.autocast's (float32 vs "
            "bfloat16 sum of its uses); untied gradients match", results)
