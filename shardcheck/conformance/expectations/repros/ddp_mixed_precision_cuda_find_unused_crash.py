"""F82: torch DDP's experimental mixed precision with `find_unused_parameters=True` (what DDP's
documentation prescribes for a model with frozen or unused parameters) raises in backward even when
every parameter is used: its reduce-and-upcast hook (`ddp_comm_hooks/mixed_precision_hooks.py`)
casts `p.grad` of the bucket's parameters, and one is None there: "AttributeError: 'NoneType' object
has no attribute 'to'". One CUDA device (nccl, world size 1); seen on an H200 with torch
2.11.0+cu130, with and without a frozen block or buffers."""

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.parallel.distributed import _MixedPrecision

from _launch import verdict
from _one_cuda_rank import make, one_cuda_rank


def body():
    model = DDP(make(), device_ids=[0], find_unused_parameters=True,
                mixed_precision=_MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(3, 1, generator=g).cuda(), torch.randn(3, 4, generator=g).cuda()
    F.mse_loss(model(x).float(), y).backward()
    return "stepped backward"


if __name__ == "__main__":
    results = one_cuda_rank(body)
    verdict("'NoneType' object has no attribute 'to'" in results[0],
            "DDP's mixed precision with find_unused_parameters=True raises AttributeError in backward", results)
