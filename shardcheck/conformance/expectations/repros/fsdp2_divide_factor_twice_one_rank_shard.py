"""F71: FSDP2 divides the gradients by set_gradient_divide_factor(d) TWICE (sum / d**2) when the
shard group has one rank and the division happens outside the collective: a reduce dtype of float16
(overflow risk: d is split into a pre- and a post-divide), set_force_sum_reduction_for_comms(True),
or an MTIA device. foreach_reduce's one-rank branch copies `reduce_scatter_input /
gradient_divide_factor`, and then the post-divide factor that _get_gradient_divide_factors computed
from the same d is applied after the all-reduce (_fsdp_collectives.py). Meshes with a shard dimension
of one rank: HSDP (n, 1), world size 1, and FSDP2 as DDP. Silent: no error, gradients d times too
small (for d = 1 nothing shows). Float32 / bfloat16 without force-sum divide once (no post-divide)."""

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from _launch import run, verdict


def one(world_size, shape, reduce_dtype, force_sum, factor=2.0):
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = fully_shard(nn.Linear(4, 4, bias=False), mesh=mesh, mp_policy=MixedPrecisionPolicy(reduce_dtype=reduce_dtype))
    model.set_gradient_divide_factor(factor)
    model.set_force_sum_reduction_for_comms(force_sum)
    model(torch.full((1, 4), float(torch.distributed.get_rank() + 1))).sum().backward()
    got = model.weight.grad.full_tensor()[0, 0].item()
    want = sum(range(1, world_size + 1)) / factor  # every weight's gradient on rank r is r + 1
    return f"{shape} {str(reduce_dtype).removeprefix('torch.')}{' force-sum' if force_sum else ''}: {got:g} (want {want:g})"


def body(rank, world_size):
    return "; ".join(one(world_size, shape, dtype, force) for shape, dtype, force in (
        ((world_size, 1), torch.float16, False), ((world_size, 1), torch.float32, True),
        ((world_size, 1), torch.float32, False), ((1, world_size), torch.float16, False)))


if __name__ == "__main__":
    results = run(body, world_size=2)
    verdict(all("(2, 1) float16: 0.75 (want 1.5)" in r and "(2, 1) float32 force-sum: 0.75 (want 1.5)" in r
                and "(2, 1) float32: 1.5 (want 1.5)" in r and "(1, 2) float16: 1.5 (want 1.5)" in r
                for r in results.values()),
            "with a one-rank shard group, float16 reduction or force-sum divides by d twice (sum / d**2)", results)
