"""F44: Megatron-FSDP (optim_grads_params, every Linear a unit) gathers every unit not yet run at once:
its all-gather prefetch size is "capped" with `max(1_000_000_000, suggested_communication_unit_size)`
(megatron_fsdp.py, MegatronFSDP.__init__: the comment says "Cap to 1B elements"), a floor, so the
prefetch budget is at least 5e8 elements and a model below that is prefetched whole. The bytes of
all-gathered weight storages alive at each unit's forward: the first unit alone, then the seven
others all at once at the second, each released after its own forward. FULL_SHARD holds about one
unit (and the next, prefetched) at a time. The max applies only when the DDP config's
`suggested_communication_unit_size` is None, so setting it should avoid the floor (not tried here)."""

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from _launch import run, verdict

UNITS = 8


def body(rank, world_size):
    from shardcheck.conformance.adapters import megatron_cpu
    from megatron_fsdp import fully_shard

    megatron_cpu.install()  # CUDA calls made no-ops: the CPU shim of the adapter
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(UNITS)])
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("fsdp", "tp"))
    wrapped, optimizer = fully_shard(model, torch.optim.Adam(model.parameters()), device_mesh=mesh,
                                     dp_shard_dim="fsdp", tp_dim="tp", device=torch.device("cpu"),
                                     fsdp_unit_modules=[nn.Linear], preproc_state_dict_for_dcp_ckpt=False)
    linears = [m for m in wrapped.modules() if isinstance(m, nn.Linear)]
    seen = []

    def gathered_now(module, args):  # after Megatron's own pre-forward hook has gathered `module`
        storages = {p.data.untyped_storage().data_ptr(): p.data.untyped_storage().nbytes()
                    for m in linears for p in m.parameters() if p.data.numel() == p.numel()}
        seen.append((sum(storages.values()), sum(n > 0 for n in storages.values())))

    for m in linears:
        m.register_forward_pre_hook(gathered_now)
    for _ in range(2):
        optimizer.zero_grad()
        wrapped(torch.randn(4, 64)).square().mean().backward()
        optimizer.step()
    most, storages = max(seen)
    return (f"most gathered at a unit's forward: {most / full:.2f}x of the model ({most} of {full} bytes, "
            f"in {storages} gathered storages); at each unit's forward of the last step: "
            + " ".join(f"{n / full:.2f}" for n, _ in seen[-UNITS:]))


if __name__ == "__main__":
    results = run(body, world_size=2, timeout_s=120)
    shares = [float(r.split(": ")[2].split("x")[0]) for r in results.values() if "most gathered" in r]
    verdict(len(shares) == 2 and min(shares) > 0.5,
            "more than half the model gathered at once in forward (FULL_SHARD: about one unit of eight)", results)
