"""F25: Megatron-FSDP's fully_shard raises ZeroDivisionError when no submodule is an FSDP unit (the
root alone sharded, fsdp_unit_modules None): MegatronFSDP._init_fsdp_param_and_grad_buffer divides
the parameter count by the number of FSDP unit modules, 0 here. torch's FSDP1/FSDP2 and the
reference shard a model as one root unit."""

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from _launch import run, verdict


def body(rank, world_size):
    from shardcheck.conformance.adapters import megatron_cpu
    from megatron_fsdp import fully_shard

    megatron_cpu.install()  # CUDA calls made no-ops: the CPU shim of the adapter
    model = nn.Sequential(nn.Linear(4, 4))
    mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("fsdp", "tp"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        fully_shard(model, optimizer, device_mesh=mesh, dp_shard_dim="fsdp", tp_dim="tp",
                    device=torch.device("cpu"), fsdp_unit_modules=None,
                    preproc_state_dict_for_dcp_ckpt=False)
    except ZeroDivisionError as exc:
        return f"ZeroDivisionError: {exc}"
    return "wrapped"


if __name__ == "__main__":
    results = run(body, world_size=2, timeout_s=90)
    verdict(all("ZeroDivisionError" in str(r) for r in results.values()),
            "fully_shard with no FSDP unit module raises ZeroDivisionError", results)
