"""F66: torch Distributed Checkpoint's load of a checkpoint whose `.metadata` index is missing or cut
in half raises "AssertionError: metadata is None" (2.10, 2.11; a bare AssertionError on 2.9) inside a
CheckpointException, naming no file. From 2.12 the message adds "global metadata read failed: [Errno 2]
No such file or directory: '.../.metadata'" (or "pickle data was truncated"). The verdict is per
release (REPRODUCED where the release behaves as recorded): unnamed before 2.12, named from 2.12.1."""

import os
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from _launch import run, verdict


def _load_error(path):
    try:
        dcp.load({"model": {"weight": torch.zeros(64)}}, checkpoint_id=path)
        return "loaded"
    except BaseException as exc:  # CheckpointException derives from BaseException
        return f"{type(exc).__name__}: {exc}"


def body(rank, world_size):
    out = []
    for damage in ("missing_index", "truncated_index"):
        path = f"{tempfile.gettempdir()}/shardcheck-f66-{os.getppid()}-{damage}"
        dcp.save({"model": {"weight": torch.ones(64)}}, checkpoint_id=path)
        dist.barrier()
        if rank == 0:
            index = os.path.join(path, ".metadata")
            if damage == "missing_index":
                os.remove(index)
            else:
                os.truncate(index, os.path.getsize(index) // 2)
        dist.barrier()
        message = _load_error(path)
        out.append(f"{damage}: names .metadata: {'.metadata' in message}: {message.strip().splitlines()[-1][:100]}")
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
    return " | ".join(out)


if __name__ == "__main__":
    results = run(body, world_size=2)
    before_fix = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < (2, 12)
    unnamed = any("names .metadata: False" in r for r in results.values())
    verdict(unnamed == before_fix,
            f"torch {torch.__version__}: DCP's load of a missing or truncated .metadata "
            f"{'names no file (fixed in 2.12)' if before_fix else 'names it (fixed in 2.12)'}", results)
