"""F69: DeepSpeed's `torch_autocast` mode (its documented alternative to the bf16 mode, F13) keeps the
parameters, and so the float32 master weights, in float32 and runs the engine's forward under
torch.autocast: the precision is decided per operator (a Linear computes in bfloat16 and returns
bfloat16), not per module. At a module's boundary its parameters and its float32 inputs are float32,
where FSDP-style mixed precision (MixedPrecision / MixedPrecisionPolicy param_dtype=bfloat16) casts
them to bfloat16 before the module's forward. The master weight keeps the original float32 value."""

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
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    original = model[0].weight.detach().clone()
    seen = {}
    model[0].register_forward_pre_hook(lambda m, args: seen.update(input=args[0].dtype, weight=m.weight.dtype))
    model[0].register_forward_hook(lambda m, args, out: seen.update(output=out.dtype))
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.Adam(model.parameters()), config={
        "train_batch_size": world_size, "zero_optimization": {"stage": 2},
        "torch_autocast": {"enabled": True, "dtype": "bfloat16"}})
    engine.backward(engine(torch.randn(1, 8)).float().pow(2).mean())
    master = safe_get_full_fp32_param(engine.module[0].weight)
    return (f"first Linear: input {seen['input']}, weight {seen['weight']}, output {seen['output']}; "
            f"master == original float32 weight: {torch.equal(master, original)}")


if __name__ == "__main__":
    results = run(body, world_size=2, timeout_s=120)
    verdict(all("input torch.float32, weight torch.float32, output torch.bfloat16; master == original float32 weight: True"
                in r for r in results.values()),
            "torch_autocast: float32 parameters and inputs at the module's boundary, bfloat16 inside (op-level "
            "autocast), the float32 master weight kept", results)
