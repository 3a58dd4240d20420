"""F39: Megatron-FSDP cuts a unit's flat buffer into per-rank chunks that are whole multiples of the
least common multiple of its parameters' row sizes, so a unit with an odd width makes every rank hold
at least that many elements: a block of Linear(64, 61) and Linear(61, 64) (7,808 parameters) gives
each of 1024 ranks a shard of lcm(64, 61) = 3,904 elements, half the model, instead of about 8.
transformer-1b's blocks (d_model 2048, an FFN of 5461) would need a 45.8 GB buffer per rank at 1024
ranks (`shardcheck simulate --impl megatron-fsdp --world-size 1024 --model transformer-1b`). One
process plays rank 0 of 1024 on torch's fake process group: shapes are real, data is not."""

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from shardcheck.conformance.simulate.fake_group import fake_world


def main() -> int:
    from shardcheck.conformance.adapters import megatron_cpu
    from megatron_fsdp import fully_shard

    megatron_cpu.install()  # CUDA calls made no-ops: the CPU shim of the adapter
    world = 1024
    with fake_world(0, world):
        block = nn.Sequential(nn.Linear(64, 61, bias=False), nn.Linear(61, 64, bias=False))
        model = nn.Sequential(block)
        mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("fsdp", "tp"))
        wrapped, _ = fully_shard(model, torch.optim.SGD(model.parameters(), lr=0.1), device_mesh=mesh,
                                 dp_shard_dim="fsdp", tp_dim="tp", device=torch.device("cpu"),
                                 fsdp_unit_modules=[nn.Sequential], preproc_state_dict_for_dcp_ckpt=False)
        params = sum(p.numel() for p in model.parameters())
        padded = max(group.model_weight_buffer.data_size
                     for group in wrapped.param_and_grad_buffer.parameter_groups)
    print(f"{params} parameters; rank 0 of {world} holds a weight shard of {padded} elements")
    if padded >= 64 * 61:
        print("REPRODUCED: each rank's shard is a whole lcm(64, 61) = 3904 elements, half the model")
        return 0
    print("NOT REPRODUCED")
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
