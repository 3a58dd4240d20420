"""F59: Accelerate's `load_state` of an FSDP1 checkpoint saved with state_dict_type=SHARDED_STATE_DICT
(the format its FSDP guide recommends) restores no optimizer state into the freshly built optimizer
of a resumed run: `load_fsdp_optimizer` asks DCP to fill `FSDP.optim_state_dict(model, optimizer)`,
which for an optimizer that has not stepped yet lists param_groups and no state, so DCP reads no
moment and no step count, and Adam silently starts over (bias correction of step 1 on the restored
parameters). The files hold the state (the .distcp files are the same size as the model's or larger).
FSDP2's path (get_optimizer_state_dict, which initialises the state first) restores it.

On a CPU-only machine Accelerate does not build FSDP at all (F27): the lines marked SHIM give the
state what accelerate/state.py gives it on a GPU machine."""

import os
import shutil
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F

from _launch import run, verdict


def _trainer(rank, world_size, seed):
    from accelerate import Accelerator, PartialState
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    AcceleratorState._reset_state(reset_partial_state=True)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=1, state_dict_type="SHARDED_STATE_DICT")
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    for state in (PartialState(), accelerator.state):  # SHIM (F27)
        state.distributed_type = DistributedType.FSDP  # SHIM
        state.device = torch.device("cpu")  # SHIM
    accelerator.state.fsdp_plugin = plugin  # SHIM
    torch.manual_seed(seed)
    model = accelerator.prepare(nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 1)))
    optimizer = accelerator.prepare(torch.optim.Adam(model.parameters(), lr=0.1))
    return accelerator, model, optimizer


def body(rank, world_size):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    path = f"{tempfile.gettempdir()}/shardcheck-f59-{os.getppid()}"
    accelerator, model, optimizer = _trainer(rank, world_size, seed=0)
    for _ in range(2):
        accelerator.backward(F.mse_loss(model(torch.randn(2, 4)), torch.ones(2, 1)))
        optimizer.step()
        optimizer.zero_grad()
    saved = {k: v["step"].item() for k, v in optimizer.state_dict()["state"].items()}
    accelerator.save_state(path)
    accelerator, model, optimizer = _trainer(rank, world_size, seed=1)  # a fresh run resumes
    accelerator.load_state(path)
    loaded = {k: v["step"].item() for k, v in optimizer.state_dict()["state"].items()}
    accelerator.wait_for_everyone()
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    return f"Adam state saved (step per parameter): {saved}; after load_state: {loaded}"


if __name__ == "__main__":
    results = run(body, world_size=2, timeout_s=60)
    verdict(all("after load_state: {}" in r and "saved (step per parameter): {}" not in r for r in results.values()),
            "Accelerate FSDP1 SHARDED_STATE_DICT: load_state restores no optimizer state into a fresh optimizer",
            results)
