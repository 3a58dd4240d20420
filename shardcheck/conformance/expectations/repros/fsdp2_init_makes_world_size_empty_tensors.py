"""F68: FSDP2's `fully_shard` cuts every parameter into world-size chunks on every rank and makes the
chunks past its last row one empty tensor at a time (`_chunk_with_empty`, twice per parameter): a
parameter of r rows costs 2 * (N - r) `new_empty` calls on each of N ranks, so its construction work
grows with the world size, not with the rank's shard. On a meta-device model (the usual large-scale
init) `new_empty` runs torch's Python reference. transformer-1b (292 parameters) on meta, rank 0,
fake group, no instrument: `fully_shard` of every block and the root takes 0.4 s at 1,024 ranks,
5.4 s at 4,096 and 41.5 s at 16,384 (27.4 s with Python's garbage collector off). One process plays
rank 0 on torch's fake process group: shapes are real, data is not."""

import time

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils._python_dispatch import TorchDispatchMode

from shardcheck.conformance.simulate.fake_group import fake_world

ROWS = 64


class CountNewEmpty(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func is torch.ops.aten.new_empty.default
        return func(*args, **(kwargs or {}))


def fully_shard_one_linear(world: int, count: bool) -> tuple[int, float]:
    """`new_empty` calls (when counted) and seconds of `fully_shard` on one meta Linear(64, ROWS)."""
    with fake_world(0, world):
        model = nn.Linear(64, ROWS, bias=False, device="meta")
        mesh = init_device_mesh("cpu", (world,))
        counter = CountNewEmpty() if count else None
        start = time.perf_counter()
        if counter:
            with counter:
                fully_shard(model, mesh=mesh)
        else:
            fully_shard(model, mesh=mesh)
        return (counter.calls if counter else 0), time.perf_counter() - start


def main() -> int:
    ok = True
    for world in (1024, 16384):
        calls, _ = fully_shard_one_linear(world, count=True)
        _, seconds = fully_shard_one_linear(world, count=False)
        print(f"world {world}: fully_shard of one {ROWS}-row meta parameter made {calls} empty tensors "
              f"(2 * ({world} - {ROWS}) = {2 * (world - ROWS)}) in {seconds * 1e3:.0f} ms")
        ok &= calls == 2 * (world - ROWS)
    if ok:
        print("REPRODUCED: each rank makes 2 * (world size - rows) empty tensors per parameter at init")
        return 0
    print("NOT REPRODUCED")
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
