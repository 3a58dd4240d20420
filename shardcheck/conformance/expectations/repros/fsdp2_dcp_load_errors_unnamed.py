"""F32: torch Distributed Checkpoint's load of a truncated .distcp file (fully_shard model + Adam via
get_state_dict / dcp.save) fails with torch's 'PytorchStreamReader failed reading zip archive', which
names no file, wrapped in a CheckpointException (a BaseException: `except Exception` misses it). A
missing file (FileNotFoundError with its path) and a size mismatch ('... for model.0.weight') are
named; the truncated file is not."""

import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.fsdp import fully_shard

from _launch import run, verdict


def _trained(width):
    torch.manual_seed(0)
    model = fully_shard(nn.Sequential(nn.Linear(7, width), nn.ReLU(), nn.Linear(width, 1)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(4, 7)).sum().backward()
    optimizer.step()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def _load_error(path, width):
    try:
        dcp.load(_trained(width), checkpoint_id=path)
        return "loaded"
    except BaseException as exc:  # CheckpointException derives from BaseException
        kind = "Exception" if isinstance(exc, Exception) else "BaseException"
        return f"{type(exc).__name__} ({kind}): {exc}"


def body(rank, world_size):
    root = f"/tmp/shardcheck-f27-{os.getppid()}"
    out = []
    for damage in ("truncated",):
        path = f"{root}/{damage}"
        dcp.save(_trained(5), checkpoint_id=path)
        dist.barrier()
        if rank == 0 and damage != "other_shape":
            victim = f"{path}/__0_0.distcp"
            if damage == "truncated":
                os.truncate(victim, os.path.getsize(victim) // 2)
            else:
                os.remove(victim)
        dist.barrier()
        message = _load_error(path, 6 if damage == "other_shape" else 5)
        out.append(f"{damage}: names the file: {'__0_0.distcp' in message}; "
                   f"{message.splitlines()[0]} ... {message.strip().splitlines()[-1][:110]}")
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    return " | ".join(out)


if __name__ == "__main__":
    results = run(body, world_size=2, timeout_s=90)
    verdict(all("names the file: False" in results[r] and "PytorchStreamReader" in results[r] for r in results),
            "DCP's load of a truncated .distcp file raises an error that does not name the file", results)
