"""F41: FSDP1 NO_SHARD (use_orig_params=True) gives a parameter the loss never uses a ZERO gradient that
the optimizer sees, where unsharded training (and DDP with find_unused_parameters=True) leaves it
None and FSDP1's sharded strategies leave it None too. The NO_SHARD flat gradient is the whole flat
parameter's, and its views are handed to every original parameter. Torch's optimizers skip
parameters whose gradient is None; with a zero gradient AdamW's weight decay (and momentum from
earlier steps) moves a parameter that unsharded training leaves untouched.
Found by the training_loop family."""

import torch
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy

from _launch import run, verdict


class WithSpare(nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.spare = nn.Linear(2, 2), nn.Linear(2, 2)

    def forward(self, x):
        return self.used(x)  # self.spare is never called


def body(rank, world_size):
    torch.manual_seed(0)
    model = FSDP(WithSpare(), device_id=torch.device("cpu"), use_orig_params=True,
                 sharding_strategy=ShardingStrategy.NO_SHARD)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
    model(torch.ones(3, 2)).sum().backward()
    spare = model.module.spare.weight
    grad = None if spare.grad is None else spare.grad.abs().sum().item()
    before = spare.detach().clone()
    optimizer.step()
    return f"unused weight: grad {grad}, moved by the step: {not torch.equal(before, spare.detach())}"


if __name__ == "__main__":
    results = run(body, world_size=2)
    verdict(all("grad 0.0" in r and "moved by the step: True" in r for r in results.values()),
            "NO_SHARD gives an unused parameter a zero gradient; AdamW's weight decay then moves it", results)
