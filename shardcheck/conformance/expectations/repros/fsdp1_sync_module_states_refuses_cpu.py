"""F72: FSDP1's `sync_module_states=True`, its documented way to load a model held by rank 0 alone (the
other ranks build it on the meta device and give it storage with `param_init_fn`), refuses a module on
the CPU even with `device_id=cpu` and a gloo group that can broadcast CPU tensors: `_init_utils.
_check_module_states_for_sync_module_states` raises "The module has CPU parameters or buffers when
`sync_module_states=True`, which requires them to be on GPU". FSDP's docstring: "sync_module_states=True
requires GPU communication"."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from _launch import run, verdict


def body(rank, world_size):
    cpu = torch.device("cpu")
    if rank == 0:
        model = nn.Linear(4, 4)  # rank 0 holds the loaded weights
    else:
        with torch.device("meta"):
            model = nn.Linear(4, 4)
    try:
        FSDP(model, device_id=cpu, sync_module_states=True,
             param_init_fn=lambda m: m.to_empty(device=cpu, recurse=False))
    except ValueError as e:
        return f"refused: {e}"
    return f"wrapped on {dist.get_backend()}"


if __name__ == "__main__":
    results = run(body, world_size=2, timeout_s=60)
    verdict(all("requires them to be on GPU" in str(r) for r in results.values()),
            "FSDP1's sync_module_states refused a CPU module on gloo", results)
