"""F63: DeepSpeed ZeRO-1 and ZeRO-2: after `engine.load_checkpoint`, `deepspeed.utils.
safe_get_full_optimizer_state(param, "exp_avg")` (the documented way to read a parameter's optimizer
state) raises "TypeError: argument of type 'NoneType' is not iterable" (tensor_fragment.py: the
parameter's optim_fragment is None) until the next step re-links the fragments. Before the save it
works, and ZeRO-3 works after the load too. The loaded state itself trains on correctly."""

import functools
import os
import shutil

import torch
import torch.distributed as dist

from _launch import run, verdict


def _engine(stage, world_size):
    import deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.ReLU(), torch.nn.Linear(5, 1))
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2), config={
        "train_batch_size": world_size, "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True})
    return engine


def _read(engine):
    from deepspeed.utils import safe_get_full_optimizer_state

    try:
        value = safe_get_full_optimizer_state(next(engine.module.parameters()), "exp_avg")
        return f"read {tuple(value.shape)}"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def body(stage, rank, world_size):
    os.environ.update(LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no JIT build of the shm op
    path = f"/tmp/shardcheck-f63-{os.getppid()}"
    engine = _engine(stage, world_size)
    engine.backward(engine(torch.randn(4, 7)).sum())
    engine.step()
    before = _read(engine)
    engine.save_checkpoint(path, tag="tag")
    dist.barrier()
    fresh = _engine(stage, world_size)
    fresh.load_checkpoint(path, tag="tag")
    after = _read(fresh)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    return f"ZeRO-{stage}: before the save {before}; after load_checkpoint {after}"


if __name__ == "__main__":
    results = {}
    for stage in (1, 2, 3):
        for rank, result in run(functools.partial(body, stage), world_size=2, timeout_s=60).items():
            results[f"{rank} stage {stage}"] = result
    text = " | ".join(results.values())
    verdict("ZeRO-1: before the save read" in text and "ZeRO-2: before the save read" in text
            and "ZeRO-1: before the save read (5, 7); after load_checkpoint TypeError" in text
            and "ZeRO-2: before the save read (5, 7); after load_checkpoint TypeError" in text
            and "ZeRO-3: before the save read (5, 7); after load_checkpoint read (5, 7)" in text,
            "ZeRO-1/2: safe_get_full_optimizer_state raises after load_checkpoint (ZeRO-3 reads it)", results)
