"""DeepSpeed bf16: the float32 master weights are made from the bf16-cast model, so the original
float32 values are lost before the first step (FSDP-style mixed precision keeps them).

    python conformance/expectations/repros/deepspeed_bf16_master_weights.py
Exit 0 and "REPRODUCED" when the master weights equal bf16(original) rather than the original.
"""

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def rank(r: int, world: int, store_dir: str, out) -> None:
    os.environ.update(LOCAL_RANK=str(r), RANK=str(r), WORLD_SIZE=str(world), DS_ACCELERATOR="cpu")
    dist.init_process_group("gloo", store=dist.FileStore(f"{store_dir}/store", world), rank=r, world_size=world)
    import deepspeed
    import deepspeed.ops
    from deepspeed.utils import safe_get_full_fp32_param

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no JIT build of the shm op
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    original = model.weight.detach().clone()
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.Adam(model.parameters()), config={
        "train_batch_size": world, "bf16": {"enabled": True}, "zero_optimization": {"stage": 2}})
    master = safe_get_full_fp32_param(engine.module.weight)
    if r == 0:
        out.put((torch.equal(master, original), torch.equal(master, original.bfloat16().float())))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    world, queue = 2, mp.get_context("spawn").Queue()
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(rank, args=(world, d, queue), nprocs=world, start_method="spawn")
    kept, rounded = queue.get()
    if rounded and not kept:
        print("REPRODUCED: DeepSpeed's bf16 fp32 master weight == bf16(original float32 weight)")
        sys.exit(0)
    print(f"not reproduced: master equals original: {kept}, equals bf16-rounded original: {rounded}")
    sys.exit(1)
