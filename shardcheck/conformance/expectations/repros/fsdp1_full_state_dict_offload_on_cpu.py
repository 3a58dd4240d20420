"""F58: FSDP1's FULL_STATE_DICT with FullStateDictConfig(offload_to_cpu=True) on a model that lives on
the CPU fails in `_unshard_fsdp_state_params` ('setStorage: ... out of bounds for storage of size 0'),
on rank 0 (rank0_only=True; its peer then loses the connection), at world size 2 with units (a
nested FSDP), after one step. offload_to_cpu=False works. Accelerate's
`get_state_dict` and `save_state` (FULL_STATE_DICT, its FSDP1 default) always pass offload_to_cpu=True,
so neither works for an FSDP1 model on CPU."""

import torch
import torch.nn as nn
from torch.distributed.fsdp import FullStateDictConfig, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from _launch import run, verdict


def _full(model, offload):
    config = FullStateDictConfig(offload_to_cpu=offload, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
        return model.state_dict()


def body(rank, world_size):
    torch.manual_seed(0)
    cpu = torch.device("cpu")
    model = nn.Sequential(nn.Linear(7, 5), nn.ReLU(), nn.Linear(5, 3), nn.ReLU(), nn.Linear(3, 1))
    model[0], model[2] = FSDP(model[0], device_id=cpu), FSDP(model[2], device_id=cpu)
    model = FSDP(model, device_id=cpu)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(4, 7)).sum().backward()
    optimizer.step()
    keys = len(_full(model, offload=False))  # the workaround works
    _full(model, offload=True)
    return f"both state dicts built ({keys} keys)"


if __name__ == "__main__":
    results = run(body, world_size=2)
    verdict("out of bounds for storage of size 0" in results[0],
            "FSDP1 FULL_STATE_DICT(offload_to_cpu=True) fails on a CPU model; offload_to_cpu=False works",
            results)
