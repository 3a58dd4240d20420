"""F49: torchtitan SimpleFSDP, run eagerly, all-gathers a checkpointed layer's parameters again in
backward: its all-gather is the parametrization that computes each parameter in forward, and
torch.utils.checkpoint recomputes the layer's forward, parametrization included. Without
checkpointing eager SimpleFSDP gathers once per step and keeps the value (F33), which is what
SHARD_GRAD_OP promises; with it, each checkpointed parameter is gathered twice. (Under FULL_SHARD
that second gather is the promised backward re-gather; torchtitan's compiled trainer decides by a
graph pass, not eagerly.)"""

import re

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.checkpoint import checkpoint

from _collectives import counting
from _launch import run, verdict


class Net(nn.Module):
    def __init__(self, checkpointed):
        super().__init__()
        self.embed, self.layer, self.checkpointed = nn.Linear(8, 8), nn.Linear(8, 8), checkpointed

    def forward(self, x):
        h = self.embed(x)
        return checkpoint(self.layer, h, use_reentrant=False) if self.checkpointed else self.layer(h)


def gathers(checkpointed, world_size):
    from torchtitan.experiments.graph_trainer.simple_fsdp import data_parallel

    model = data_parallel(Net(checkpointed), init_device_mesh("cpu", (world_size,)), "fully_shard")
    with counting() as seen:
        model(torch.randn(2, 8)).sum().backward()
    return seen.seen["all_gather"][0] + seen.seen["allgather"][0]


def body(rank, world_size):
    return f"all-gathers in one step: without checkpointing {gathers(False, world_size)}, with it {gathers(True, world_size)}"


if __name__ == "__main__":
    results = run(body, world_size=2, timeout_s=60)
    counts = [[int(n) for n in re.findall(r"checkpointing (\d+), with it (\d+)", r)[0]] if "with it" in r else []
              for r in results.values()]
    verdict(all(len(c) == 2 and c == [4, 6] for c in counts),
            "eager SimpleFSDP gathers the checkpointed layer's weight and bias again in backward", results)
