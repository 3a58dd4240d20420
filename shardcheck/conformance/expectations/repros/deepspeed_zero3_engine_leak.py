"""F14: DeepSpeed ZeRO-3 `engine.destroy()` does not release the engine: its model stays reachable
from deepspeed.runtime.zero.parameter_offload.FWD_MODULE_STACK (appended in forward, never popped)
and from a class-level lru_cache on PartitionedParameterCoordinator.__params_to_release, keyed by
the coordinator. A process that builds many engines (a test worker) keeps every model alive."""

import gc
import os
import weakref

import torch

from _launch import run, verdict


def body(rank, world_size):
    os.environ.update(LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no JIT build of the shm op
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    alive = weakref.ref(model)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config={
        "train_batch_size": world_size, "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True})
    engine.backward(engine(torch.randn(2, 8)).sum())
    engine.step()
    engine.destroy()
    del engine, model
    gc.collect()
    return f"model alive after destroy() and gc.collect(): {alive() is not None}"


if __name__ == "__main__":
    results = run(body, world_size=2, timeout_s=120)
    verdict(all(r == "returned: model alive after destroy() and gc.collect(): True" for r in results.values()),
            "the model of a destroyed ZeRO-3 engine is still alive after gc.collect()", results)
