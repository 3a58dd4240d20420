"""F36: Megatron-FSDP's default mixed-precision policy (`main_params_dtype=torch.float32`) builds a
main-weight buffer beside the model-weight buffer even when the model is float32 already: every rank
holds two float32 copies of its parameter shard between steps (plus its gradient-buffer shard), one
shard more than FULL_SHARD needs. At 2 ranks that is 0.86x of what unsharded training holds."""

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from _launch import run, verdict


def body(rank, world_size):
    from shardcheck.conformance.adapters import megatron_cpu
    from megatron_fsdp import fully_shard

    megatron_cpu.install()  # CUDA calls made no-ops: the CPU shim of the adapter
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
    mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("fsdp", "tp"))
    wrapped, _ = fully_shard(model, torch.optim.Adam(model.parameters()), device_mesh=mesh, dp_shard_dim="fsdp",
                             tp_dim="tp", device=torch.device("cpu"), fsdp_unit_modules=[nn.Linear],
                             preproc_state_dict_for_dcp_ckpt=False)
    held = {}
    for group in wrapped.param_and_grad_buffer.parameter_groups:
        for kind in ("model_weight_buffer", "main_weight_buffer", "main_grad_buffer"):
            buffer = getattr(group, kind)
            if buffer is not None and buffer.data is not None:
                held[kind] = held.get(kind, 0) + buffer.data.numel() * buffer.data.element_size()
    return "float32 model; per rank: " + ", ".join(f"{k} {v}" for k, v in sorted(held.items()))


if __name__ == "__main__":
    results = run(body, world_size=2, timeout_s=120)
    verdict(all("main_weight_buffer" in r and "model_weight_buffer" in r for r in results.values()),
            "two float32 weight buffers (model and main) per rank for a float32 model", results)
