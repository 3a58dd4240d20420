"""F48: FSDP1 and FSDP2 keep a module's buffers per rank and never broadcast them, as DDP does
before forward (broadcast_buffers, its default): BatchNorm's running statistics follow each rank's
own batches, so after one training step the ranks evaluate the same input to different outputs. DDP's ranks hold rank 0's. torch documents no buffer sync for FSDP; a
user coming from DDP gets rank-dependent evaluation and checkpoints (rank 0's saved) silently."""

import torch
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from _buffers import evaluation_spread
from _launch import run, verdict


def spread(wrap, rank):
    torch.manual_seed(0)
    model = wrap(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
    torch.manual_seed(1 + rank)  # each rank its own batch
    model(torch.randn(8, 4)).sum().backward()
    return f"{evaluation_spread(model):.3g}"


def body(rank, world_size):
    cpu = torch.device("cpu")
    return (f"one input evaluated on every rank, largest difference: DDP {spread(DDP, rank)}, "
            f"FSDP1 {spread(lambda m: FSDP(m, device_id=cpu), rank)}, FSDP2 {spread(fully_shard, rank)}")


if __name__ == "__main__":
    results = run(body, world_size=2, timeout_s=60)
    verdict(all("DDP 0, " in str(r) and "FSDP1 0," not in str(r) and not str(r).endswith("FSDP2 0")
                for r in results.values()),
            "FSDP1 and FSDP2 leave BatchNorm's running statistics different on every rank (DDP: rank 0's)", results)
