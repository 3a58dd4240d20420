"""F56: FSDP1 with an auto_wrap_policy wraps every BatchNorm apart with mixed precision disabled
(`MixedPrecision._module_classes_to_ignore`, default `(_BatchNorm,)`, documented as experimental):
under MixedPrecision(param_dtype=bfloat16, buffer_dtype=bfloat16) the BatchNorm keeps its parameters
and running statistics in float32 (CPU's batch_norm takes the bfloat16 input with them), while every
other module follows the policy. The same BatchNorm wrapped by hand (no auto_wrap_policy) follows it. Accelerate's and
Lightning's FSDP1 paths always wrap through an auto_wrap_policy."""

import torch
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from _launch import run, verdict

POLICY = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)


def dtypes_seen(auto_wrap: bool) -> str:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    seen = []
    model[1].register_forward_pre_hook(lambda m, args: seen.append(
        f"input {args[0].dtype}, weight {m.weight.dtype}, running_mean {m.running_mean.dtype}"))
    common = dict(mixed_precision=POLICY, device_id=torch.device("cpu"), use_orig_params=True)
    if auto_wrap:
        model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({nn.BatchNorm1d}), **common)
    else:
        model[1] = FSDP(model[1], **common)
        model = FSDP(model, **common)
    model(torch.randn(4, 6)).sum().backward()
    return seen[0].replace("torch.", "")


def body(rank, world_size):
    return f"BatchNorm saw, auto-wrapped: {dtypes_seen(True)}; wrapped by hand: {dtypes_seen(False)}"


if __name__ == "__main__":
    results = run(body, world_size=2, timeout_s=60)
    verdict(all("auto-wrapped: input bfloat16, weight float32, running_mean float32; wrapped by hand: input bfloat16, "
                "weight bfloat16, running_mean bfloat16" in r for r in results.values()),
            "FSDP1's auto_wrap_policy takes BatchNorm out of the MixedPrecision policy (float32 weights and buffers)",
            results)
