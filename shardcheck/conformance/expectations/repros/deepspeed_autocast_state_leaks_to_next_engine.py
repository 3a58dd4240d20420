"""F76: an engine built with DeepSpeed's `torch_autocast` enabled sets process-wide state
(deepspeed/runtime/torch_autocast.py: the module globals TORCH_AUTOCAST_INITIALIZED and
TORCH_AUTOCAST_DTYPE, under "TODO: Avoid using global variables") that nothing clears, not
engine.destroy(). Every later engine of the process then takes the torch_autocast branch: ZeRO-1/2
(stage_1_and_2.py: `if is_autocast_initialized(): comm_dtypes = get_all_comm_dtypes(...)`, and
base_optimizer.get_param_comm_dtype) reduce each gradient in its parameter's dtype and ignore the
engine's own `communication_data_type`.

Each rank: engine B (ZeRO-1, float32, communication_data_type bf16, no torch_autocast) reduces a bias
gradient chosen so that a bf16 reduction and a float32 one differ; alone in its process B reduces in
bf16; built after (and destroyed) engine A with torch_autocast, B reduces in float32."""

import functools
import os

import torch
import torch.nn as nn

from _launch import run, verdict

GRADS = {0: [20.03, 3.0001, -7.77], 1: [-19.4, 1.0003, 7.79]}  # bias gradient of each rank


def engine(ds, rank, world_size, extra):
    model = nn.Linear(1, 3)
    config = {"train_batch_size": world_size, "train_micro_batch_size_per_gpu": 1,
              "zero_allow_untested_optimizer": True, "zero_optimization": {"stage": 1}, **extra}
    eng, *_ = ds.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), config=config)
    return eng


def body(after_autocast, rank, world_size):
    os.environ.update(DS_ACCELERATOR="cpu", LOCAL_RANK=str(rank))
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    if after_autocast:
        a = engine(deepspeed, rank, world_size, {"torch_autocast": {"enabled": True, "dtype": "bfloat16"}})
        a.destroy()
    b = engine(deepspeed, rank, world_size, {"communication_data_type": "bf16"})
    b.backward((b.module.bias * torch.tensor(GRADS[rank])).sum())
    got = safe_get_full_grad(b.module.bias).tolist()
    bf16 = ((torch.tensor(GRADS[0]).bfloat16() + torch.tensor(GRADS[1]).bfloat16()) / 2).float().tolist()
    fp32 = ((torch.tensor(GRADS[0]) + torch.tensor(GRADS[1])) / 2).tolist()
    how = "bf16" if got == bf16 else "float32" if torch.allclose(torch.tensor(got), torch.tensor(fp32)) else "?"
    return f"{'after a torch_autocast engine' if after_autocast else 'alone'}: reduced in {how} {got}"


if __name__ == "__main__":
    results = {}
    for after in (False, True):
        for rank, result in run(functools.partial(body, after), world_size=2, timeout_s=120).items():
            results[f"{rank} {'after' if after else 'alone'}"] = result
    text = " | ".join(results.values())
    verdict(text.count("alone: reduced in bf16") == 2 and text.count("after a torch_autocast engine: reduced in float32") == 2,
            "after an engine with torch_autocast, a later engine of the process ignores communication_data_type "
            "(bf16) and reduces in float32", results)
