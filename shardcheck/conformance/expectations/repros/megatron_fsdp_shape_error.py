"""F26: Megatron-FSDP's flat-buffer layout cuts a small 2-D parameter mid-row at a shard boundary, and
fully_shard then fails to view the rank's slice as rows ("shape '[-1, 6]' is invalid for input of
size 16" on rank 0, "... of size 2" on rank 1).

The parameters of one group (here the whole model, one FSDP unit: Linear 6-3-8-1 without biases)
get a `chunk_size_factor`, the lcm of their row sizes (8, 6, 3: 24), and shards are multiples of it.
A parameter smaller than that factor is a "fragment", packed at the next free offset whatever its
row size: the (8, 3) weight fills [0, 24), the (1, 8) one [24, 32), and the (3, 6) one lands at
[32, 50) of a 96-element bucket, whose shard boundary at 48 splits it 16 + 2. `make_fsdp_dtensor` then calls
`local_tensor.view(-1, 6)`. The layout is Megatron-FSDP's own arithmetic
(`build_data_parallel_buffer_index`, printed first, no process group); the failure is raised while
fully_shard builds its buffers, before any collective, so the adapter's CPU shim (which only pads
unequal all-gathers, makes CUDA calls no-ops and allocates on the CPU) plays no part in it."""

import types

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from _launch import run, verdict


def layout() -> None:
    from megatron_fsdp.param_and_grad_buffer import build_data_parallel_buffer_index

    config = types.SimpleNamespace(data_parallel_sharding_strategy="optim_grads_params")
    shapes = [torch.Size([1, 8]), torch.Size([3, 6]), torch.Size([8, 3])]  # the group's order: row sizes descending
    for rank in range(2):
        items, _, shard = build_data_parallel_buffer_index(shapes, rank, 2, True, config, chunk_size_factor=24)
        start, end = shard.global_data_index, shard.global_data_index + shard.size
        item = items[1]  # the (3, 6) weight
        inside = max(0, min(end, item.global_data_index + item.size) - max(start, item.global_data_index))
        print(f"layout: rank {rank} shard [{start}, {end}), the (3, 6) weight at "
              f"[{item.global_data_index}, {item.global_data_index + item.size}): {inside} elements here")


def body(rank, world_size):
    from shardcheck.conformance.adapters import megatron_cpu
    from megatron_fsdp import fully_shard

    megatron_cpu.install()  # CUDA calls made no-ops, CPU buffers: the adapter's shim, nothing else of it
    model = nn.Sequential(nn.Linear(6, 3, bias=False), nn.Linear(3, 8, bias=False), nn.Linear(8, 1, bias=False))
    mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("fsdp", "tp"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    fully_shard(model, optimizer, device_mesh=mesh, dp_shard_dim="fsdp", tp_dim="tp", device=torch.device("cpu"),
                fsdp_unit_modules=[nn.Sequential], zero_dp_strategy="optim_grads_params",
                preproc_state_dict_for_dcp_ckpt=False)
    return "wrapped"


if __name__ == "__main__":
    layout()
    results = run(body, world_size=2, timeout_s=90)
    verdict(all("is invalid for input of size" in str(r) for r in results.values()),
            "fully_shard cuts a fragment parameter mid-row at a shard boundary (shape error)", results)
