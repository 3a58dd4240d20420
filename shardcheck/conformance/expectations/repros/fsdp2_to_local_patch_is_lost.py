"""F7: patching fsdp_pre_all_gather onto `param.to_local()` (as torch's old monkey-patch test did)
has no effect in torch 2.13: to_local() returns a fresh view each time (gh-166156), so the hook is
never called and the test passes vacuously. Patch `param._local_tensor` with bound methods instead."""

import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

from _launch import run, verdict


def body(rank, world_size):
    model = fully_shard(nn.Linear(4, 4, bias=False))
    calls = []

    def pre(self, mesh, outer_size, outer_stride, module, mp_policy):
        calls.append(1)
        return (self,), None

    local = model.weight.to_local()
    local.fsdp_pre_all_gather = pre.__get__(local)
    model(torch.randn(2, 4)).sum().backward()
    return f"fresh view: {model.weight.to_local() is not local}, hook calls: {len(calls)}"


if __name__ == "__main__":
    results = run(body, world_size=2)
    verdict(all(r == "returned: fresh view: True, hook calls: 0" for r in results.values()),
            "a hook patched on param.to_local() is never called", results)
