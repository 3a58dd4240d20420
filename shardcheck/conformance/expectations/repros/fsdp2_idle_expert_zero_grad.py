"""FSDP2 with set_reduce_scatter_unused_params(True) -- what its documentation prescribes when ranks use
different parameters ("mixture of experts") -- gives an expert that NO rank routed a token to in a step
a zero gradient, where unsharded training and DDP with find_unused_parameters=True (which all-reduces
its map of locally used parameters for exactly this, pytorch/pytorch#28294) leave it None. Torch's
optimizers skip a None gradient; with zeros AdamW decays the expert and steps it by its moments.
Found by the training_loop family's knobs (test_training_loop_knobs_experts.py, idle_everywhere)."""

import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

from _launch import run, verdict


class TwoExperts(nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])

    def forward(self, x, used):
        return sum(self.experts[e](x) for e in used)  # an expert with no token is not called


def body(rank, world_size):
    torch.manual_seed(0)
    model = TwoExperts()
    fully_shard(model)
    model.set_reduce_scatter_unused_params(True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
    for used in ([0, 1], [0]):  # step 1: expert 1 gets no token on any rank
        model(torch.ones(3, 2), used).sum().backward()
        grad = model.experts[1].weight.grad
        before = model.experts[1].weight.detach().full_tensor()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    moved = not torch.equal(before, model.experts[1].weight.detach().full_tensor())
    kind = "None" if grad is None else "zero" if not grad.full_tensor().any() else "nonzero"
    return f"expert idle on every rank: grad {kind}, moved by the step: {moved}"


if __name__ == "__main__":
    results = run(body, world_size=2)
    verdict(all("grad zero, moved by the step: True" in r for r in results.values()),
            "an expert no rank used gets a zero gradient and AdamW moves it", results)
