"""F10: torch.nn.utils.clip_grad_norm_ cannot combine the norms of fully_shard units on different
meshes (an NO_SHARD-like unit on a (replicate=2, shard=1) mesh, a FULL_SHARD unit on (2,)):
'All operands in aten.stack.default must have the same mesh'."""

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from _launch import run, verdict


def body(rank, world_size):
    flat = init_device_mesh("cpu", (world_size,))
    hsdp = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fully_shard(model[0], mesh=hsdp)
    fully_shard(model[1], mesh=flat)
    fully_shard(model, mesh=flat)
    model(torch.randn(2, 4)).sum().backward()
    try:
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    except RuntimeError as exc:  # torch 2.9 wraps the ValueError: "Sharding propagation failed for ... stack"
        if isinstance(exc.__cause__, ValueError):
            raise exc.__cause__ from None
        raise
    return f"norm {total}"


if __name__ == "__main__":
    results = run(body, world_size=2)
    verdict(all("must have the same mesh" in r for r in results.values()),
            "clip_grad_norm_ over units on different meshes raises", results)
