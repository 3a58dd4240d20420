"""F57: before torch 2.13, FSDP1's optimizer state dict (FSDP.optim_state_dict, which DCP's
get_state_dict calls) maps parameter keys with an all-gather over the DEFAULT group, not over the
FSDP module's process group (`_optim_utils._map_param_key_to_optim_keys`). A model sharded over a
subgroup (two of four ranks, as a job that resumes at a smaller world size, or one data-parallel
group of several) waits for ranks that never join: its checkpoint save or load hangs until the
collective timeout. From 2.13 it finishes. The verdict is per release."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from _launch import run, verdict

TIMEOUT_S = 10


def body(rank, world_size):
    group = dist.new_group([0, 1])  # every rank creates it; only ranks 0 and 1 are in it
    if rank >= 2:
        return "not in the subgroup"
    torch.manual_seed(0)
    model = FSDP(nn.Linear(4, 4), process_group=group, device_id=torch.device("cpu"), use_orig_params=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    get_state_dict(model, optimizer)
    return "optimizer state dict taken"


if __name__ == "__main__":
    results = run(body, world_size=4, timeout_s=TIMEOUT_S)
    before_fix = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13)
    hung = all("taken" not in results[r] for r in (0, 1))
    verdict(hung == before_fix and all("taken" in results[r] for r in (0, 1)) != before_fix,
            f"torch {torch.__version__}: FSDP1's optimizer state dict over a subgroup "
            f"{'waits on the default group (hangs; fixed in 2.13)' if before_fix else 'finishes (fixed in 2.13)'}",
            results)
