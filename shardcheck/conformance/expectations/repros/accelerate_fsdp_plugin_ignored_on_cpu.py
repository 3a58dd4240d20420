"""F27: on a machine without an accelerator, `Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin())`
does not shard and says nothing. Without `cpu=True` the state is DistributedType.NO: `prepare` returns
the model unwrapped and each rank trains on its own (gradients never averaged). With `cpu=True` (as
`accelerate launch --cpu` sets it) the state is MULTI_CPU, which state.py does not give the plugin:
`prepare` wraps the model in DistributedDataParallel."""

import os

import torch
import torch.nn as nn

from _launch import run, verdict


def body(rank, world_size):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import FullyShardedDataParallelPlugin

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")  # as torchrun / accelerate launch set them
    seen = []
    for cpu in (False, True):
        AcceleratorState._reset_state(reset_partial_state=True)
        accelerator = Accelerator(cpu=cpu, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=1))
        model = nn.Linear(4, 2)
        model, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        seen.append(f"cpu={cpu}: {accelerator.distributed_type.value} {type(model).__name__}")
    return "; ".join(seen)


if __name__ == "__main__":
    results = run(body, world_size=2, timeout_s=60)
    verdict(all("cpu=False: NO Linear; cpu=True: MULTI_CPU DistributedDataParallel" in r for r in results.values()),
            "Accelerator(fsdp_plugin=...) on CPU: no wrapping (cpu=False) or DDP (cpu=True), silently", results)
