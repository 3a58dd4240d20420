"""F40: FSDP1 `no_sync()` under MixedPrecision(param_dtype=bfloat16, reduce_dtype=float32) accumulates
the micro-batches' unsharded gradients in bfloat16: the post-backward hook returns before its cast to
the reduce dtype when gradients are not synced (torch/distributed/fsdp/_runtime_utils.py,
`_post_backward_hook`: `if not state._sync_gradients: ... return` precedes
`flat_param.grad.to(handle._reduce_dtype)`), so autograd adds each micro-batch into the bfloat16
gradient of the low-precision flat parameter. Syncing every micro-batch accumulates the reduced
gradients in float32; FSDP2 (`set_requires_gradient_sync(False)`) accumulates in the reduce dtype.
The same three micro-batches give gradients that differ by bfloat16 rounding of the running sum.
Found by the training_loop family."""

import torch
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision

from _launch import run, verdict


def _grads(rank, quiet: bool):
    torch.manual_seed(0)
    model = FSDP(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1)), device_id=torch.device("cpu"),
                 use_orig_params=True, mixed_precision=MixedPrecision(torch.bfloat16, torch.float32))
    dtypes = []
    for j in range(3):
        torch.manual_seed(100 * j + rank)
        x = torch.randn(16, 8)
        ctx = model.no_sync() if quiet and j < 2 else torch.enable_grad()
        with ctx:
            model(x).float().pow(2).mean().div(3).backward()
        if quiet and j < 2:
            dtypes.append(str(model._handle.flat_param.grad.dtype).removeprefix("torch."))
    with FSDP.summon_full_params(model, with_grads=True):
        return torch.cat([p.grad.reshape(-1).float() for p in model.parameters()]), dtypes


def body(rank, world_size):
    every, _ = _grads(rank, quiet=False)
    quiet, dtypes = _grads(rank, quiet=True)
    close = torch.allclose(quiet, every, rtol=1.3e-6, atol=1e-5)
    return f"held gradient dtype inside no_sync {dtypes}; max |no_sync - sync every| {float((quiet - every).abs().max()):.3g}; close={close}"


if __name__ == "__main__":
    results = run(body, world_size=2)
    verdict(all("bfloat16" in r and "close=False" in r for r in results.values()),
            "no_sync under MixedPrecision accumulates unsharded gradients in param_dtype (bfloat16), not reduce_dtype",
            results)
