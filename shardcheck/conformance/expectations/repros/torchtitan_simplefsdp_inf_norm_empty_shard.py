"""F9 through torchtitan: SimpleFSDP shards a parameter with fewer rows than ranks as a DTensor with an
empty local shard, and torchtitan.distributed.utils.clip_grad_norm_(norm_type=inf) (torch's
get_total_norm underneath) fails on those ranks: '_foreach_norm cannot compute the infinity norm on
an empty tensor'. Finite norm types are fine."""

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from _launch import run, verdict


def body(rank, world_size):
    from torchtitan.distributed.utils import clip_grad_norm_
    from torchtitan.experiments.graph_trainer.simple_fsdp import data_parallel

    torch.manual_seed(0)
    model = data_parallel(nn.Linear(4, 1), init_device_mesh("cpu", (world_size,)), "fully_shard")  # rank 1: no rows
    model(torch.randn(3, 4)).sum().backward()
    return f"inf-norm {float(clip_grad_norm_(list(model.parameters()), 1.0, norm_type=float('inf'))):.4f}"


if __name__ == "__main__":
    results = run(body, world_size=2, timeout_s=60)
    verdict("infinity norm on an empty tensor" in results[1],
            "torchtitan clip_grad_norm_(inf) fails on the rank with an empty SimpleFSDP shard (rank 1 of 2)", results)
