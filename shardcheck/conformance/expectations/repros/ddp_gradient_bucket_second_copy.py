"""F43: DistributedDataParallel with its defaults (gradient_as_bucket_view=False) keeps every gradient
twice on every rank: `.grad` tensors of their own, and the reducer's flat buckets it all-reduces in
(as large as the parameters, kept from step to step). Unsharded data parallelism needs one copy;
`gradient_as_bucket_view=True` makes `.grad` views of the buckets and drops the second."""

import torch
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from _launch import run, verdict


def held(as_view: bool) -> str:
    """The bytes of the distinct storages behind `.grad` and of the buckets DDP all-reduced in the
    last step (seen by a comm hook that runs torch's own all-reduce), in parameters' bytes."""
    torch.manual_seed(0)
    model = DDP(nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)]), gradient_as_bucket_view=as_view)
    buckets = {}

    def recording(state, bucket):
        storage = bucket.buffer().untyped_storage()
        buckets[storage.data_ptr()] = storage.nbytes()
        return default_hooks.allreduce_hook(state, bucket)

    model.register_comm_hook(None, recording)
    optimizer = torch.optim.Adam(model.parameters())
    for _ in range(2):
        buckets.clear()
        optimizer.zero_grad()
        model(torch.randn(4, 64)).square().mean().backward()
        optimizer.step()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    grads = {p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage().nbytes() for p in model.parameters()}
    both = {**grads, **buckets}  # a .grad that is a view of a bucket counts once
    return (f"gradient_as_bucket_view={as_view}: .grad {sum(grads.values()) / params:.2f}x of the parameters, "
            f"buckets {sum(buckets.values()) / params:.2f}x, held together {sum(both.values()) / params:.2f}x")


def body(rank, world_size):
    return "; ".join(held(as_view) for as_view in (False, True))


if __name__ == "__main__":
    results = run(body, world_size=2, timeout_s=120)
    verdict(all("gradient_as_bucket_view=False: .grad 1.00x of the parameters, buckets 1.00x, held together 2.00x"
                in r for r in results.values()),
            "DDP's default keeps the gradients twice (.grad and the reducer's buckets)", results)
