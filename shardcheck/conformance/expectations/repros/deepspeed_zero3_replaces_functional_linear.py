"""F31: a DeepSpeed ZeRO-3 engine replaces torch.nn.functional.linear for the whole process (its
`memory_efficient_linear`, on by default: partition_parameters._enable_mem_efficient_linear, which
logs "This will persist unless manually reset"), and engine.destroy() does not put it back: every
later F.linear in the process, of any model and any other engine, runs through DeepSpeed's
autograd function. shardcheck's harness found it (a test may not leave a torch.nn.functional
function replaced); the adapter restores it in close()."""

import os

import torch

from _launch import run, verdict


def body(rank, world_size):
    os.environ.update(LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no JIT build of the shm op
    original = torch.nn.functional.linear
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config={
        "train_batch_size": world_size, "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True})
    engine.backward(engine(torch.randn(2, 8)).sum())
    engine.step()
    engine.destroy()
    now = torch.nn.functional.linear
    return f"F.linear replaced after destroy(): {now is not original} ({getattr(now, '__qualname__', now)})"


if __name__ == "__main__":
    results = run(body, world_size=2, timeout_s=120)
    verdict(all(r.startswith("returned: F.linear replaced after destroy(): True") for r in results.values()),
            "a destroyed ZeRO-3 engine leaves torch.nn.functional.linear replaced for the whole process", results)
