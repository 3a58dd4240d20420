"""F13: DeepSpeed bf16 makes its float32 master weights from the bf16-cast model, so the original
float32 values are lost before the first step (FSDP-style mixed precision keeps them)."""

import os

import torch

from _launch import run, verdict


def body(rank, world_size):
    os.environ.update(LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    import deepspeed
    import deepspeed.ops
    from deepspeed.utils import safe_get_full_fp32_param

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no JIT build of the shm op
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    original = model.weight.detach().clone()
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.Adam(model.parameters()), config={
        "train_batch_size": world_size, "bf16": {"enabled": True}, "zero_optimization": {"stage": 2}})
    master = safe_get_full_fp32_param(engine.module.weight)
    return (f"master == original: {torch.equal(master, original)}, "
            f"master == bf16(original): {torch.equal(master, original.bfloat16().float())}")


if __name__ == "__main__":
    results = run(body, world_size=2, timeout_s=120)
    verdict(all(r == "returned: master == original: False, master == bf16(original): True" for r in results.values()),
            "DeepSpeed's bf16 fp32 master weight == bf16(original float32 weight)", results)
