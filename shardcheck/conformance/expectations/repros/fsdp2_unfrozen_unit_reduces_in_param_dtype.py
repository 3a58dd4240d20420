"""F53 (pytorch#186998): under MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32), an
FSDP2 unit whose first forward ran with every parameter frozen (a fine-tuning schedule's first
steps) resolves no reduce dtype (`FSDPParamGroup._init_mp_dtypes` looks at the trainable parameters
only). Once unfrozen, its gradients are reduced in bfloat16 and the bfloat16 gradient is assigned to
the float32 sharded parameter: backward raises. A unit trainable at its first forward trains.
Fixed in torch 2.14 (pytorch PR #187376): the verdict is per release (raises before 2.14, trains in
float32 from 2.14 on; NOT REPRODUCED if a release behaves otherwise)."""

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from _launch import run, verdict


def body(rank, world_size):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    model[0].requires_grad_(False)  # frozen for the first step
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard(model[0], mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    x = torch.randn(2, 4)
    model(x).sum().backward()  # step 0: model[0] frozen
    model[0].requires_grad_(True)  # step 1: unfrozen
    try:
        model(x).sum().backward()
    except RuntimeError as exc:
        return f"after unfreezing: {str(exc).splitlines()[0][:90]}"
    return f"after unfreezing: trained, gradient dtype {model[0].weight.grad.dtype}"


if __name__ == "__main__":
    results = run(body, world_size=2, timeout_s=60)
    before_fix = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < (2, 14)
    expected = "assign a gradient with dtype 'c10::BFloat16'" if before_fix else "trained, gradient dtype torch.float32"
    verdict(all(expected in str(r) for r in results.values()),
            f"torch {torch.__version__}: an FSDP2 unit frozen at its first forward "
            f"{'reduces in param_dtype once unfrozen (pytorch#186998)' if before_fix else 'trains once unfrozen (fixed in 2.14)'}",
            results)
