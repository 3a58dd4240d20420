"""F11: an fsdp_pre_all_gather that returns wrongly sized inputs on one rank is detected only on
ranks that hold padding (_fsdp_param.py says so); the other ranks block in the all-gather until
the process group times out, instead of every rank raising the size error."""

import math
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from _launch import run, verdict

from shardcheck.conformance.checks.support.subclasses import TwoTensor  # torch's test subclass, ported

TIMEOUT_S = 5


def _pad(x, rows):
    return torch.cat([x, x.new_zeros(rows - x.shape[0], *x.shape[1:])]) if rows > x.shape[0] else x


class Hooked(TwoTensor):
    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Hooked(inner["a"], inner["b"], outer_size, outer_stride)

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        rows = math.ceil(outer_size[0] / mesh.size()) + (dist.get_rank() == mesh.size() - 1)  # last: +1
        return (_pad(self.a, rows), _pad(self.b, rows)), None

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        if out is not None:
            return None
        a, b = outputs
        return Hooked(a, b).to(param_dtype), (a, b)


def body(rank, world_size):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 3, bias=False), nn.ReLU(), nn.Linear(3, 8, bias=False))
    for lin in (model[0], model[2]):
        lin.weight = nn.Parameter(Hooked(lin.weight.detach(), lin.weight.detach().clone()))
    fully_shard(model)
    try:
        model(torch.randn(2, 8)).sum().backward()
    except AssertionError:
        time.sleep(TIMEOUT_S + 1)  # stay in the group (as a test's rank does) while the others wait
        raise
    return "forward and backward ran"


if __name__ == "__main__":
    results = run(body, world_size=2, timeout_s=TIMEOUT_S)
    blocked = [r for r, text in results.items() if "padded sharded size" not in text]
    verdict(results[1].startswith("raised AssertionError") and blocked == [0] and "padded" not in results[0],
            "only the last rank raised the size error; rank 0 blocked in the all-gather until the timeout",
            results)
