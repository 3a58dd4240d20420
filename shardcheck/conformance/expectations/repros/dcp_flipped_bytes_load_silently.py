"""F60: torch Distributed Checkpoint records no checksum of what it writes: bytes flipped in place in
a .distcp file (the same size: a bit rot, a bad copy) load without an error where they fall in a
tensor's bytes, and the run resumes from values nobody saved. (Where they fall in a pickled record,
the load fails with 'PytorchStreamReader failed reading ...', naming no file: F32.) torch.load does
not check its zip records' CRC-32 either."""

import os
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from _launch import run, verdict


def body(rank, world_size):
    path = f"{tempfile.gettempdir()}/shardcheck-f60-{os.getppid()}"
    torch.manual_seed(0)
    saved = {"weight": torch.randn(4096)}  # replicated: DCP writes it once, in rank 0's file
    dcp.save({"model": {"weight": saved["weight"]}}, checkpoint_id=path)
    dist.barrier()
    if rank == 0:
        victim = os.path.join(path, "__0_0.distcp")
        data = bytearray(open(victim, "rb").read())
        middle = len(data) // 2
        for i in range(middle - 32, middle + 32):
            data[i] ^= 0xFF
        open(victim, "wb").write(bytes(data))
    dist.barrier()
    loaded = {"model": {"weight": torch.zeros(4096)}}
    try:
        dcp.load(loaded, checkpoint_id=path)
        outcome = "loaded without an error"
    except BaseException as exc:  # CheckpointException derives from BaseException
        outcome = f"raised {type(exc).__name__}"
    changed = int((loaded["model"]["weight"] != saved["weight"]).sum())
    dist.barrier()
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    return f"{outcome}; {changed} of 4096 values differ from the saved ones"


if __name__ == "__main__":
    results = run(body, world_size=2)
    verdict(all("loaded without an error" in r for r in results.values())
            and any(" 0 of 4096" not in r for r in results.values()),
            "DCP loads a .distcp file with bytes flipped in place silently, with other values", results)
