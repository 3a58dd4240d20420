"""F33: torchtitan SimpleFSDP's `fully_shard` mode, run eagerly, keeps every gathered parameter from
forward to backward: autograd saves the replicated (all-gathered) weight of each Linear for its
backward, so a rank holds the whole model at the end of forward, and backward gathers nothing again.
FSDP's FULL_SHARD frees each unit's gathered parameters after its forward and gathers them again in
backward; SimpleFSDP does that only as a graph pass of torchtitan's compiled trainer."""

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from _launch import run, verdict


def body(rank, world_size):
    from torchtitan.experiments.graph_trainer.simple_fsdp import data_parallel

    model = nn.Sequential(*[nn.Linear(64, 64, bias=False) for _ in range(4)])
    model = data_parallel(model, init_device_mesh("cpu", (world_size,)), "fully_shard")
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        loss = model(torch.randn(2, 64)).sum()
    loss.backward()
    # layers 2-4 save their weight for the input's gradient (layer 1's input needs none)
    return f"weights saved whole for backward: {sum(s == (64, 64) for s in saved)} of 3"


if __name__ == "__main__":
    results = run(body, world_size=2, timeout_s=60)
    verdict(all("saved whole for backward: 3 of 3" in str(r) for r in results.values()),
            "fully_shard keeps the gathered (64, 64) weights alive from forward to backward", results)
