"""F80: torch DDP's experimental mixed precision (`mixed_precision=_MixedPrecision(...)`) cannot run
a forward under `torch.no_grad()` (an evaluation): its pre-forward hook registers a gradient hook on
each low-precision parameter through `p.expand_as(p).grad_fn.next_functions`, and without autograd
`grad_fn` is None: "AttributeError: 'NoneType' object has no attribute 'next_functions'". One CUDA
device (nccl, world size 1); seen on an H200 with torch 2.11.0+cu130, fp16 and bf16, with and
without find_unused_parameters and a frozen block."""

import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.parallel.distributed import _MixedPrecision

from _launch import verdict
from _one_cuda_rank import make, one_cuda_rank


def body():
    model = DDP(make(), device_ids=[0],
                mixed_precision=_MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32))
    with torch.no_grad():
        model(torch.randn(3, 1, device="cuda"))
    return "evaluated under no_grad"


if __name__ == "__main__":
    results = one_cuda_rank(body)
    verdict("'NoneType' object has no attribute 'next_functions'" in results[0],
            "DDP's mixed precision raises AttributeError in a forward under torch.no_grad()", results)
