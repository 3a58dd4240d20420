"""F15: a refused FSDP1 `register_comm_hook` is not all-or-nothing. It walks the units root first,
asserting and assigning one by one; when a sub-unit already holds a hook it raises "A communication
hook is already registered", but the units visited before it keep the refused hook and state."""

import torch
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from _launch import run, verdict


def hook(state, grad, output=None):
    pass


def body(rank, world_size):
    cpu = torch.device("cpu")
    model = FSDP(nn.Sequential(nn.Linear(4, 4), FSDP(nn.Linear(4, 4), device_id=cpu)), device_id=cpu)
    inner = model.module[1]
    inner._comm_hook, inner._comm_hook_state = hook, None  # a hook already on the sub-unit (as seed 004 plants it)
    try:
        model.register_comm_hook(None, hook)
    except AssertionError:
        return f"refused; the root holds the refused hook: {model._comm_hook is hook}"
    return "accepted"


if __name__ == "__main__":
    results = run(body, world_size=2)
    verdict(all(r == "returned: refused; the root holds the refused hook: True" for r in results.values()),
            "register_comm_hook raised, yet the root unit now holds the refused hook", results)
