"""F19: Megatron-FSDP's fully_shard (fully_shard_optimizer) runs a real optimizer.step() on zero
gradients to build the optimizer state before training: Adam's step counter starts at 1 (the first
real update uses the bias correction of step 2) and weight decay (SGD, Adam, AdamW) changes every
parameter before any training step."""

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from _launch import run, verdict


def body(rank, world_size):
    from shardcheck.conformance.adapters import megatron_cpu
    from megatron_fsdp import fully_shard

    megatron_cpu.install()  # CUDA calls made no-ops: the CPU shim of the adapter
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4, bias=False))
    before = model[0].weight.detach().clone()
    mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("fsdp", "tp"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    wrapped, optimizer = fully_shard(model, optimizer, device_mesh=mesh, dp_shard_dim="fsdp", tp_dim="tp",
                                     device=torch.device("cpu"), fsdp_unit_modules=[nn.Linear],
                                     preproc_state_dict_for_dcp_ckpt=False)
    (param,) = wrapped.parameters()
    steps = [float(s["step"]) for s in optimizer.state.values()]
    local = param.to_local().detach()
    offset = rank * (4 // world_size)
    changed = not torch.equal(local, before[offset: offset + local.shape[0]])
    return f"steps before training {steps}, weights changed before training: {changed}"


if __name__ == "__main__":
    results = run(body, world_size=2, timeout_s=90)
    verdict(all("steps before training [1.0], weights changed before training: True" in r for r in results.values()),
            "fully_shard took an AdamW step on zero gradients: step counter 1, weights decayed", results)
