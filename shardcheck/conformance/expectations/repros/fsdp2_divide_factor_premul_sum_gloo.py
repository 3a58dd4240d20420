"""F70: FSDP2's set_gradient_divide_factor(d) on a gloo (CPU) process group raises 'Cannot use
ReduceOp.PREMUL_SUM with Gloo' in backward whenever the shard group has more than one rank and d is
not its size: for float32 / bfloat16 gradients _get_gradient_divide_factors picks
ReduceOp.PREMUL_SUM(1/d) for the reduce-scatter without asking whether the backend has it (it asks
only for MTIA). NCCL has it; gloo and the threaded test backend do not. set_force_sum_reduction_for_comms(True)
(plain sums, a separate division) is the documented way round it; d equal to the shard group's size
(ReduceOp.AVG) and shard groups of one rank (no reduce-scatter) are unaffected."""

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from _launch import run, verdict


def one(world_size, factor, force_sum=False):
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    model = fully_shard(nn.Linear(4, 4, bias=False), mesh=mesh)
    model.set_gradient_divide_factor(factor)
    model.set_force_sum_reduction_for_comms(force_sum)
    model(torch.full((1, 4), float(torch.distributed.get_rank() + 1))).sum().backward()
    return model.weight.grad.full_tensor()[0, 0].item()  # sum over ranks of (rank + 1), divided by factor


def body(rank, world_size):
    out = []
    for factor, force_sum in ((3.0, False), (3.0, True), (2.0, False)):
        try:
            out.append(f"d={factor} force_sum={force_sum}: {one(world_size, factor, force_sum):.4f}")
        except RuntimeError as exc:
            out.append(f"d={factor} force_sum={force_sum}: raised {str(exc).splitlines()[0]}")
    return "; ".join(out)


if __name__ == "__main__":
    results = run(body, world_size=2)
    verdict(all("d=3.0 force_sum=False: raised Cannot use ReduceOp.PREMUL_SUM with Gloo" in r
                and "d=3.0 force_sum=True: 1.0000" in r and "d=2.0 force_sum=False: 1.5000" in r
                for r in results.values()),
            "set_gradient_divide_factor(3) raises on gloo (PREMUL_SUM); with force-sum it gives sum/3, d = 2 (AVG) works",
            results)
