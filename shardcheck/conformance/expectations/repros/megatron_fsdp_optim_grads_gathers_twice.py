"""F37: Megatron-FSDP's `optim_grads` strategy (ZeRO-2: optimizer state and gradients sharded, the
parameters whole on every rank) all-gathers twice the parameter bytes per step, as
`optim_grads_params` (ZeRO-3) does, and reduce-scatters the gradients: a rank sends 1.5x the
2 x P x (n-1)/n of a reduce-scatter and one all-gather of the updated parameters."""

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from _collectives import counting
from _launch import run, verdict


def body(rank, world_size):
    from shardcheck.conformance.adapters import megatron_cpu
    from megatron_fsdp import fully_shard

    megatron_cpu.install()  # CUDA calls made no-ops: the CPU shim of the adapter
    out = []
    for strategy in ("optim_grads", "optim_grads_params"):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
        mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("fsdp", "tp"))
        wrapped, optimizer = fully_shard(model, torch.optim.Adam(model.parameters()), device_mesh=mesh,
                                         dp_shard_dim="fsdp", tp_dim="tp", device=torch.device("cpu"),
                                         fsdp_unit_modules=[nn.Linear], zero_dp_strategy=strategy,
                                         preproc_state_dict_for_dcp_ckpt=False)
        wrapped.ddp_config.gradient_reduce_div_fusion = False  # gloo has no PREMUL_SUM (the adapter's shim)
        with counting() as seen:
            wrapped(torch.randn(4, 64)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        out.append(f"{strategy}: {seen.table()}")
    return f"P {sum(p.numel() * 4 for p in model.parameters())} bytes; " + "; ".join(out)


if __name__ == "__main__":
    results = run(body, world_size=2, timeout_s=120)

    def gathered(r, strategy):
        part = r.split(f"{strategy}: ")[1].split(";")[0]
        return int(part.split("allgather ")[1].split(" calls ")[1].split(" bytes")[0]) if "allgather" in part else 0

    verdict(all(gathered(r, "optim_grads") >= 2 * 66560 for r in results.values()),
            "optim_grads all-gathers 2x the parameter bytes per step, as optim_grads_params does", results)
