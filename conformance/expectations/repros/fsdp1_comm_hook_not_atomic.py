"""FSDP1: a refused `register_comm_hook` is not all-or-nothing. FullyShardedDataParallel.
register_comm_hook walks the units root first, asserting and assigning one by one; when a sub-unit
already holds a hook it raises "A communication hook is already registered", but the units visited
before it keep the new hook and state.

    python conformance/expectations/repros/fsdp1_comm_hook_not_atomic.py
Exit 0 and "REPRODUCED" when the root holds the refused hook after the AssertionError.
"""

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


def hook(state, grad, output=None):
    pass


def rank(r: int, world: int, store_dir: str, out) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(f"{store_dir}/store", world), rank=r, world_size=world)
    cpu = torch.device("cpu")
    model = FSDP(torch.nn.Sequential(torch.nn.Linear(4, 4), FSDP(torch.nn.Linear(4, 4), device_id=cpu)), device_id=cpu)
    inner = model.module[1]
    inner._comm_hook, inner._comm_hook_state = hook, None  # a hook already on the sub-unit (as seed 004 plants it)
    try:
        model.register_comm_hook(None, hook)
        refused = False
    except AssertionError:
        refused = True
    if r == 0:
        out.put((refused, model._comm_hook is hook))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    world, queue = 2, mp.get_context("spawn").Queue()
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(rank, args=(world, d, queue), nprocs=world, start_method="spawn")
    refused, root_has_hook = queue.get()
    if refused and root_has_hook:
        print("REPRODUCED: register_comm_hook raised, yet the root unit now holds the refused hook")
        sys.exit(0)
    print(f"not reproduced: refused={refused}, root holds the hook={root_has_hook}")
    sys.exit(1)
