"""F48 in torchtitan SimpleFSDP: data_parallel turns parameters into DTensors and leaves buffers as
they are, per rank, never broadcast as DDP does before forward: BatchNorm's running statistics follow
each rank's own batches, and after one training step the ranks evaluate one input to different outputs."""

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from _buffers import evaluation_spread
from _launch import run, verdict


def body(rank, world_size):
    from torchtitan.experiments.graph_trainer.simple_fsdp import data_parallel

    torch.manual_seed(0)
    model = data_parallel(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), init_device_mesh("cpu", (world_size,)),
                          "fully_shard")
    torch.manual_seed(1 + rank)  # each rank its own batch
    model(torch.randn(8, 4)).sum().backward()
    return f"one input evaluated on every rank, largest difference {evaluation_spread(model):.3g}"


if __name__ == "__main__":
    results = run(body, world_size=2, timeout_s=60)
    verdict(all("largest difference" in r and not r.endswith("difference 0") for r in results.values()),
            "SimpleFSDP leaves BatchNorm's running statistics different on every rank (DDP: rank 0's)", results)
