"""DeepSpeed ZeRO-3: `engine.destroy()` does not release the engine: its model stays reachable from
deepspeed.runtime.zero.parameter_offload.FWD_MODULE_STACK (appended in forward, never popped) and
from a class-level lru_cache on PartitionedParameterCoordinator.__params_to_release, keyed by the
coordinator. A process that builds many engines (a test worker) keeps every model alive.

    python conformance/expectations/repros/deepspeed_zero3_engine_leak.py
Exit 0 and "REPRODUCED" when the model of a destroyed ZeRO-3 engine survives gc.collect().
"""

import gc
import os
import sys
import tempfile
import weakref

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def rank(r: int, world: int, store_dir: str, out) -> None:
    os.environ.update(LOCAL_RANK=str(r), RANK=str(r), WORLD_SIZE=str(world), DS_ACCELERATOR="cpu")
    dist.init_process_group("gloo", store=dist.FileStore(f"{store_dir}/store", world), rank=r, world_size=world)
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no JIT build of the shm op
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    alive = weakref.ref(model)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config={
        "train_batch_size": world, "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True})
    engine.backward(engine(torch.randn(2, 8)).sum())
    engine.step()
    engine.destroy()
    del engine, model
    gc.collect()
    if r == 0:
        out.put(alive() is not None)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    world, queue = 2, mp.get_context("spawn").Queue()
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(rank, args=(world, d, queue), nprocs=world, start_method="spawn")
    if queue.get():
        print("REPRODUCED: the model of a destroyed ZeRO-3 engine is still alive after gc.collect()")
        sys.exit(0)
    print("not reproduced: the destroyed engine's model was freed")
    sys.exit(1)
