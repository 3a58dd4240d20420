"""FSDP1 (use_orig_params=True, FULL_SHARD) gives an expert that NO rank routed a token to in a step a zero
gradient on the ranks whose shard of the flat parameter holds part of it (None on the others), where
unsharded training and DDP with find_unused_parameters=True leave it None: AdamW then decays those
ranks' part of the expert. F41's class (a parameter no rank uses gets zeros), under FULL_SHARD: the
unit's post-backward resets every orig parameter's is-grad-None mask ("it should receive a meaningful
gradient (even if the gradient happens to be zeros)", _flat_param.py _reset_is_grad_none).
Found by the training_loop family's knobs (test_training_loop_knobs_experts.py, idle_everywhere)."""

import torch
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from _launch import run, verdict


class TwoExperts(nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])

    def forward(self, x, used):
        return sum(self.experts[e](x) for e in used)  # an expert with no token is not called


def body(rank, world_size):
    torch.manual_seed(0)
    model = FSDP(TwoExperts(), device_id=torch.device("cpu"), use_orig_params=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
    idle = model.module.experts[1].weight  # rank 1's shard of the flat parameter holds it (rank 0's: expert 0)
    for used in ([0, 1], [0]):  # step 1: expert 1 gets no token on any rank
        model(torch.ones(3, 2), used).sum().backward()
        grad = None if idle.grad is None else "zero" if not idle.grad.any() else "nonzero"
        before = idle.detach().clone()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return f"expert idle on every rank: grad {grad}, moved by the step: {not torch.equal(before, idle.detach())}"


if __name__ == "__main__":
    results = run(body, world_size=2)
    verdict("grad zero, moved by the step: True" in results[1],
            "an expert no rank used gets a zero gradient on the rank holding it and AdamW moves it", results)
