"""F45: torchtitan SimpleFSDP's `hybrid_shard` reduces each gradient with DTensor's redistribute from
(Partial, Partial) to (Replicate, Shard(0)), and DTensor plans it mesh dimension by mesh dimension,
the replicate dimension first: the WHOLE unsharded gradient is all-reduced across the replicas, then
reduce-scattered within the shard group. HSDP's design (FSDP1 HYBRID_SHARD, FSDP2 on a 2-D mesh)
reduce-scatters first and all-reduces only the 1/n shard: SimpleFSDP sends n times the replica
traffic (2x on a 2x2 mesh). Shown on DTensor alone, as SimpleFSDP calls it."""

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.utils._python_dispatch import TorchDispatchMode

from _launch import run, verdict


class Collectives(TorchDispatchMode):
    """(op name, elements of its largest tensor operand) of every c10d op dispatched."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace in ("c10d", "_c10d_functional") and not func.__name__.startswith(("wait", "_wrap")):
            sizes = [a.numel() for a in torch.utils._pytree.tree_leaves(args) if isinstance(a, torch.Tensor)]
            self.calls.append((func.__name__.split(".")[0], max(sizes, default=0)))
        return out


def body(rank, world_size):
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    gradient = DTensor.from_local(torch.ones(64, 64), mesh, (Partial(), Partial()))  # 4096 elements per rank
    with Collectives() as seen:
        gradient.redistribute(mesh, (Replicate(), Shard(0))).to_local()
    return "collectives: " + ", ".join(f"{name} of {n} elements" for name, n in seen.calls)


if __name__ == "__main__":
    results = run(body, world_size=4, timeout_s=60)
    verdict(all("all_reduce of 4096 elements" in r for r in results.values()),
            "the replica all-reduce carries the whole 4096-element gradient, not its 2048-element shard", results)
