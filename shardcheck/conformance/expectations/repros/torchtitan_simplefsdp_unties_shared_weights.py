"""F24: torchtitan SimpleFSDP's data_parallel unties a parameter shared by two modules (tied
embeddings, a weight reused by a later layer): each module gets its own sharded copy, so the shared
weight's gradient is split between two parameters (each with its own module's part) and the two
copies drift apart after the first step. Unsharded training has one parameter and one gradient."""

import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from _launch import run, verdict


def body(rank, world_size):
    from torchtitan.experiments.graph_trainer.simple_fsdp import data_parallel

    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Tanh(), nn.Linear(4, 4, bias=False))
    model[2].weight = model[0].weight  # one parameter, used twice
    before = len(list(model.parameters()))
    model = data_parallel(model, init_device_mesh("cpu", (world_size,)), "fully_shard")
    return f"parameters before {before}, after {len(list(model.parameters()))}"


if __name__ == "__main__":
    results = run(body, world_size=2, timeout_s=60)
    verdict(all("parameters before 1, after 2" in str(r) for r in results.values()),
            "data_parallel turned one shared weight into two parameters", results)
