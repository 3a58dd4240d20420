"""F12: before the first forward, FSDP1 accepts register_comm_hook on a nested (non-root) unit:
check_is_root() lazily initialises that unit as a root, so the documented 'register_comm_hook can
only be called on a root instance.' is not raised."""

import torch
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from _launch import run, verdict


def body(rank, world_size):
    cpu = torch.device("cpu")
    model = FSDP(nn.Sequential(FSDP(nn.Linear(2, 2), device_id=cpu), nn.Linear(2, 2)), device_id=cpu)
    model.module[0].register_comm_hook(None, lambda state, grad: None)
    return "register_comm_hook on the nested unit was accepted"


if __name__ == "__main__":
    results = run(body, world_size=2)
    verdict(all(r.startswith("returned: register_comm_hook on the nested unit was accepted") for r in results.values()),
            "FSDP1 accepts register_comm_hook on a non-root unit before the first forward", results)
