"""F46: FSDP1 FULL_SHARD with a layer that is both a checkpointed module and a unit, holding units
of its own (llama's attention and MLP inside a transformer layer, PR pytorch#175406): the recomputed
forward in backward reshards the inner units when it ends, so their backward gathers them once more.
With two inner units, the first is all-gathered three times in a step (forward, recompute, backward)
where training without checkpointing, and a flat layer, gather it twice: 8 all-gathers instead of 7."""

import re

import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from _collectives import counting
from _launch import run, verdict
from _nested import Net


def gathers(checkpointed):
    torch.manual_seed(0)
    model = Net(checkpointed)
    cpu = torch.device("cpu")
    model.layer.mix = FSDP(model.layer.mix, device_id=cpu)  # units inside ...
    model.layer.mlp = FSDP(model.layer.mlp, device_id=cpu)
    model.layer = FSDP(model.layer, device_id=cpu)          # ... a unit
    model = FSDP(model, device_id=cpu)
    with counting() as seen:
        model(torch.randn(4, 8)).sum().backward()
    return seen.seen["allgather"]  # [calls, bytes]


def body(rank, world_size):
    (n0, b0), (n1, b1) = gathers(False), gathers(True)
    return f"all-gathers in one step: {n0} ({b0} bytes) without checkpointing, {n1} ({b1} bytes) with it"


if __name__ == "__main__":
    results = run(body, world_size=2, timeout_s=60)
    counts = [[int(n) for n in re.findall(r"(\d+) \(", r)] for r in results.values()]
    verdict(all(len(c) == 2 and c[1] > c[0] for c in counts),
            "FSDP1 gathers a unit nested in a checkpointed unit a third time in backward", results)
