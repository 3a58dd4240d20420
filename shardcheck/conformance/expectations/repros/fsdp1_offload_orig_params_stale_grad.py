"""F5: FSDP1 FULL_SHARD + CPUOffload(offload_params=True) + use_orig_params=True on CPU (with the F2
workaround) accumulates gradients across iterations although optim.zero_grad() sets them to None: the
post-forward reshard re-exposes the persistent `_cpu_grad` as the original parameters' .grad, the
pre-backward writeback copies it into flat_param.grad, and since a CPU gradient counts as 'not
offloaded' when the compute device is the CPU, the new gradient is added to it. An inf written at
iteration 0 (seed 001 found_inf) makes the ShardedGradScaler back off again at iteration 1."""

import torch
import torch.nn as nn
from torch.distributed.fsdp import CPUOffload
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from _launch import run, verdict


def train(rank, use_orig_params):
    torch.manual_seed(0)
    model = FSDP(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), device_id=torch.device("cpu"),  # FULL_SHARD
                 cpu_offload=CPUOffload(offload_params=True), use_orig_params=use_orig_params)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ShardedGradScaler(device="cpu", init_scale=2.0)
    scales = []
    for it in range(2):
        optim.zero_grad()  # set_to_none=True
        loss = model(torch.randn(2, 4)).sum()
        stale = any(p.grad is not None for p in model.parameters())  # before this iteration's backward
        scaler.scale(loss).backward()
        if it == 0 and rank == 0:  # as seed 001: rank 0 writes inf into its first local gradient
            next(p for p in model.parameters() if p.grad is not None).grad.fill_(float("inf"))
        scaler.step(optim)
        scaler.update()
        scales.append(scaler.get_scale())
    return f"use_orig_params={use_orig_params}: scale after it0, it1 {scales}, grad back before it1 backward: {stale}"


def body(rank, world_size):
    torch.Tensor.pin_memory = lambda self, *a, **k: self.clone()  # F2 workaround (test process only)
    torch.cpu.Stream.synchronize = lambda self: None
    return f"{train(rank, True)}; {train(rank, False)}"


if __name__ == "__main__":
    results = run(body, world_size=2)
    expected = ("use_orig_params=True: scale after it0, it1 [1.0, 0.5], grad back before it1 backward: True; "
                "use_orig_params=False: scale after it0, it1 [1.0, 1.0], grad back before it1 backward: False")
    verdict(all(r == f"returned: {expected}" for r in results.values()),
            "FSDP1 FULL_SHARD + offload_params + use_orig_params on CPU keeps the previous iteration's gradient "
            "after zero_grad(): the iteration-0 inf makes the scaler back off again at iteration 1", results)
