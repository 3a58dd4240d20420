"""F20: Megatron-FSDP leaves `p.grad` None on a rank whose slice of `p` is empty, so ranks hold
different lists of DTensor gradients; torch.nn.utils.clip_grad_norm_ (how its users clip: it has no
clip of its own) stacks the per-gradient norms and reduces that stack across ranks element by
element, mixing norms of different parameters: a wrong total norm (or, where the stacks differ in
length, a collective of unequal sizes: gloo aborts the process, NCCL would hang)."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from _launch import run, verdict


def body(rank, world_size):
    from shardcheck.conformance.adapters import megatron_cpu
    from megatron_fsdp import fully_shard

    megatron_cpu.install()  # CUDA calls made no-ops: the CPU shim of the adapter
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 5), nn.ReLU(), nn.Linear(5, 3), nn.ReLU(), nn.Linear(3, 1))
    mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("fsdp", "tp"))
    wrapped, _ = fully_shard(model, torch.optim.SGD(model.parameters(), lr=0.1), device_mesh=mesh, dp_shard_dim="fsdp",
                             tp_dim="tp", device=torch.device("cpu"), fsdp_unit_modules=[nn.Linear],
                             preproc_state_dict_for_dcp_ckpt=False)
    wrapped.ddp_config.gradient_reduce_div_fusion = False
    torch.manual_seed(rank)
    wrapped(torch.randn(6, 7)).pow(2).mean().backward()
    grads = [p.grad for p in wrapped.parameters() if p.grad is not None]
    true = torch.stack([g.to_local().pow(2).sum() for g in grads]).sum()
    dist.all_reduce(true)  # the global 2-norm, squared: every rank's gradient slices
    total = torch.nn.utils.clip_grad_norm_(list(wrapped.parameters()), 1e9).full_tensor()
    return f"{len(grads)} grads here; clip_grad_norm_ {total.item():.6f}, true norm {true.sqrt().item():.6f}"


if __name__ == "__main__":
    results = run(body, world_size=2, timeout_s=60)
    wrong = [r for r in results.values() if "clip_grad_norm_" not in r or r.split("clip_grad_norm_ ")[1].split(",")[0] != r.split("true norm ")[1]]
    verdict(bool(wrong), "torch's clip_grad_norm_ over Megatron-FSDP's gradients (None on empty slices) is wrong or aborts", results)
