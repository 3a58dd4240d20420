"""Checkpoints through torch Distributed Checkpoint (DCP), for torch's engines (FSDP2, FSDP1, ...).

`save` / `load`: the model's and optimizer's sharded state dicts from
`torch.distributed.checkpoint.state_dict.get_state_dict` (names of the unsharded model), plus the
grad scaler's state, written by `dcp.save` into the directory (one `.distcp` file per rank and a
`.metadata` index) and read back by `dcp.load` into a fresh trainer's state dicts, which DCP reshards
to the trainer's own layout, then applied with `set_state_dict`. `full_state_dict` and
`full_optimizer_state`: the model's and the optimizer's full state dicts on every rank
(`StateDictOptions(full_state_dict=True)`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.tensor import DTensor


def group_of(model) -> dist.ProcessGroup | None:
    """The process group spanning the model's ranks: its DTensors' mesh, the mesh FSDP1 was built on
    (HYBRID_SHARD's 2-D one: its `process_group` is one replica's shard group, and a save over it
    had a coordinator per replica writing the same files), or the wrapper's `process_group` (FSDP1,
    DDP); None when that is the default group."""
    mesh = next((p.device_mesh for p in model.parameters() if isinstance(p, DTensor)), None)
    mesh = mesh if mesh is not None else getattr(model, "_device_mesh", None)
    if mesh is not None:
        if mesh.size() == dist.get_world_size():
            return None
        return mesh.get_group() if mesh.ndim == 1 else mesh._flatten().get_group()
    group = getattr(model, "process_group", None)
    return None if group is None or dist.get_world_size(group) == dist.get_world_size() else group


def _state(model, optimizer, scaler) -> dict:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    if scaler is not None:
        state["scaler"] = scaler.state_dict()
    return state


def save(model, optimizer, scaler, path: str) -> None:
    dcp.save(_state(model, optimizer, scaler), checkpoint_id=path, process_group=group_of(model))


def load(model, optimizer, scaler, path: str) -> None:
    """`flatten_sharded_tensors=False`: FSDP1's sharded state dicts hold ShardedTensors, and the
    default planner's rewrite of them turns the optimizer's param_groups into one key the save never
    wrote ("Missing key in checkpoint state_dict: optim.param_groups"); DTensor state dicts (FSDP2)
    load alike either way."""
    state = _state(model, optimizer, scaler)
    dcp.load(state, checkpoint_id=path, process_group=group_of(model),
             planner=DefaultLoadPlanner(flatten_sharded_tensors=False))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if scaler is not None:
        scaler.load_state_dict(state["scaler"])


def load_from_rank0(model, device, shard):
    """`model` real on the default group's rank 0, on the meta device elsewhere: `shard(model)`, storage
    for every rank (`to_empty`), rank 0's state dict broadcast by `set_model_state_dict(full_state_dict=True,
    broadcast_from_rank0=True)`, then rank 0's non-persistent buffers (in no state dict) broadcast.
    Returns the sharded model."""
    rank0 = dist.get_rank() == 0
    state = {n: t.detach().clone() for n, t in model.state_dict().items()} if rank0 else {}
    names = [f"{path}.{name}".lstrip(".") for path, m in model.named_modules() for name in m._non_persistent_buffers_set]
    kept = {n: model.get_buffer(n).detach().clone() for n in names} if rank0 else {}
    sharded = shard(model)
    sharded.to_empty(device=device)
    set_model_state_dict(sharded, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    with torch.no_grad():
        for name in names:
            buffer = sharded.get_buffer(name)
            if rank0:
                buffer.copy_(kept[name])
            dist.broadcast(buffer, src=0)
    return sharded


def full_state_dict(model) -> dict[str, torch.Tensor]:
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {n: t.detach().clone() for n, t in full.items()}


def full_optimizer_state(model, optimizer) -> dict[str, dict]:
    """{parameter name (the unsharded model's): {state key: full value}} on every rank, from
    `get_optimizer_state_dict(full_state_dict=True)`. Collective."""
    state = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))["state"]
    return {name: dict(entry) for name, entry in state.items()}


class DCPCheckpoints:
    """The checkpoint methods of a torch-style adapter (capability `checkpoint`), through this
    module: what FSDP2, FSDP1 and DDP share."""

    def save_checkpoint(self, model, optimizer, scaler, path):
        save(model, optimizer, scaler, path)

    def load_checkpoint(self, model, optimizer, scaler, path):
        load(model, optimizer, scaler, path)

    def full_state_dict(self, model):
        return full_state_dict(model)

    def full_optimizer_state(self, model, optimizer):
        return full_optimizer_state(model, optimizer)
