"""F18: torchao's NF4Tensor implements only the tensor ops FSDP2 itself applies to a parameter
(dim-0 split / chunk, slices that start at row 0, views); reference_impl shards a parameter by
slicing its rows (`full[start:end]`) and cloning them, so it cannot shard an NF4 weight: every
rank raises NotImplementedError (a slice that is not the whole tensor from row 0), and `clone()`
would re-quantize with the default block sizes."""

import torch

from _launch import run, verdict


def body(rank, world_size):
    import torch.nn as nn
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    import shardcheck.reference_impl as ri

    torch.manual_seed(0)
    model = nn.Linear(64, 64, bias=False)
    model.weight = nn.Parameter(to_nf4(model.weight.detach(), block_size=64, scaler_block_size=4), requires_grad=False)
    ri.shard(model)
    return f"sharded: {type(ri.local_shard(model.weight)).__name__}"


if __name__ == "__main__":
    results = run(body, world_size=2, timeout_s=60)
    verdict("aten.slice(NF4Tensor) with end=32" in results[0] and "aten.slice(NF4Tensor) with start=32" in results[1],
            "reference_impl cannot shard an NF4Tensor: its row slices [0:32] and [32:64] are not implemented", results)
