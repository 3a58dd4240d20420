"""``python -m shardcheck.reference_impl.step_bench``: training-step time of the reference vs torch FSDP2.

Same CPU model (a stack of MLP blocks), world size 2, gloo, a few warm-up then timed steps of
forward + backward + Adam.  Prints the median step times and, last, one JSON line with
``ratio = reference / fsdp2`` (target <= 1.1).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

WORLD_SIZE, DIM, HIDDEN, BLOCKS, BATCH, WARMUP, STEPS = 2, 256, 1024, 6, 32, 3, 12


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(BLOCKS)], nn.Linear(DIM, DIM))


def _time_steps(model: nn.Module, rank: int) -> list[float]:
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    torch.manual_seed(rank)
    x = torch.randn(BATCH, 16, DIM)
    times = []
    for step in range(WARMUP + STEPS):
        dist.barrier()
        t0 = time.perf_counter()
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    return times[WARMUP:]


def _worker(rank: int, path: str, queue) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // WORLD_SIZE))
    dist.init_process_group("gloo", store=dist.FileStore(path, WORLD_SIZE), rank=rank, world_size=WORLD_SIZE)
    try:
        import shardcheck.reference_impl as R
        from torch.distributed.fsdp import fully_shard

        results = {}
        for _ in range(2):  # alternate twice so that neither side benefits from running first
            ref = build()
            for blk in ref[:-1]:
                R.shard(blk)
            R.shard(ref)
            results.setdefault("reference", []).extend(_time_steps(ref, rank))
            fsdp = build()
            for blk in fsdp[:-1]:
                fully_shard(blk)
            fully_shard(fsdp)
            results.setdefault("fsdp2", []).extend(_time_steps(fsdp, rank))
        queue.put((rank, {k: statistics.median(v) for k, v in results.items()}))
    finally:
        dist.destroy_process_group()


def main() -> None:
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_worker, args=(r, os.path.join(tmp, "store"), queue)) for r in range(WORLD_SIZE)]
        for p in procs:
            p.start()
        results = dict(queue.get(timeout=600) for _ in procs)
        for p in procs:
            p.join()
    ref_s = max(r["reference"] for r in results.values())
    fsdp_s = max(r["fsdp2"] for r in results.values())
    print(f"model: {BLOCKS} blocks of {DIM}->{HIDDEN}->{DIM}, batch {BATCH}x16, ws {WORLD_SIZE}, gloo, "
          f"{WARMUP} warm-up + {STEPS} timed steps (x2, alternating)")
    print(f"reference step: {ref_s * 1e3:.2f} ms   fsdp2 step: {fsdp_s * 1e3:.2f} ms")
    print(json.dumps({"reference_ms": round(ref_s * 1e3, 3), "fsdp2_ms": round(fsdp_s * 1e3, 3),
                      "ratio": round(ref_s / fsdp_s, 3), "target": 1.1}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
