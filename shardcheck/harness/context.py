"""The per-rank context a test body receives as `ctx`."""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, NoReturn

import torch
import torch.distributed as dist

from shardcheck.compat import all_gather_single
from shardcheck.harness.digest import SIZE as DIGEST_SIZE
from shardcheck.harness.digest import digest
from shardcheck.errors import ShardcheckError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

# In thread mode every rank shares torch's global RNG; seeded sections take turns through this lock.
_RNG_LOCK = threading.RLock()


def manual_seed(seed: int) -> None:
    """`torch.manual_seed(seed)`: every device's generator seeded to `seed`. In a build of torch with no
    accelerator that is the CPU generator alone; torch.manual_seed would also queue seeds for CUDA, XPU
    and MTIA, which such a build can never initialise, with a formatted stack each (a measurable
    share of a small check: docs/speed.md)."""
    if not torch.backends.cuda.is_built() and not torch.xpu.is_available():  # compile-time facts:
        # torch.accelerator.current_accelerator() would ask the CUDA driver (shardcheck.harness.cuda)
        torch.default_generator.manual_seed(seed)
    else:
        torch.manual_seed(seed)


class SeededCollective(ShardcheckError, RuntimeError):
    """A collective inside `RankContext.seeded` in thread mode (it would never return)."""


@dataclass
class RankContext:
    rank: int
    world_size: int
    backend: str
    device: torch.device
    mode: str  # one of vocabulary.MODES
    group: Any = None  # the process group of this test's ranks; None means the default group
    _records: list[Any] = field(default_factory=list, repr=False)
    _meshes: dict[Any, DeviceMesh] = field(default_factory=dict, repr=False)

    @property
    def is_threaded(self) -> bool:
        return self.mode == "thread"

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def mesh(self, shape: int | tuple[int, ...] | None = None, names: tuple[str, ...] | None = None) -> DeviceMesh:
        """A device mesh over this test's ranks (cached: sub-groups are built once per rank process)."""
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

        shape = (self.world_size,) if shape is None else (shape,) if isinstance(shape, int) else tuple(shape)
        key = (shape, tuple(names) if names else None)
        if key not in self._meshes:
            if self.group is None:
                self._meshes[key] = init_device_mesh(self.device.type, shape, mesh_dim_names=key[1])
            else:
                ranks = torch.tensor(dist.get_process_group_ranks(self.group)).reshape(shape)
                self._meshes[key] = DeviceMesh(self.device.type, ranks, mesh_dim_names=key[1])
        return self._meshes[key]

    @contextlib.contextmanager
    def seeded(self, seed: int) -> Iterator[None]:
        """Run a block with torch's RNG seeded to `seed`: identical on every rank, in every mode.

        In thread mode the RNG is global to the process, so blocks take turns (no collectives inside).
        A CPU rank seeds the CPU generator alone: `torch.manual_seed` would also queue a seed, with
        a formatted stack each, for CUDA, XPU and MTIA, which a CPU rank never initialises.
        """
        on_gpu = self.device.type == "cuda"
        with _RNG_LOCK, torch.random.fork_rng(devices=[self.device] if on_gpu else []), self._no_collective():
            if on_gpu:
                torch.manual_seed(seed)
            else:
                torch.default_generator.manual_seed(seed)
            yield

    def _no_collective(self) -> contextlib.AbstractContextManager[Any]:
        """In thread mode a collective inside a seeded block waits forever for ranks that wait for
        the block's lock: it fails at once instead, naming the collective (on CUDA, DTensor's random
        ops broadcast a seed the first time: initialise `local_part(p)` there)."""
        if not self.is_threaded:
            return contextlib.nullcontext()
        from shardcheck.harness.threads import tap_collectives

        def refuse(method: str, args: Any, backend: Any) -> NoReturn:
            raise SeededCollective(
                f"a collective ({method}) inside ctx.seeded in thread mode: the ranks share one RNG, "
                f"so seeded blocks take turns and this collective would wait forever for the others")

        return tap_collectives(refuse)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order, on every rank."""
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def digests(self, value: Any) -> list[bytes | None]:
        """Every rank's `shardcheck.harness.digest.digest(value)`, in rank order: one all-gather of a few
        bytes (`all_gather_object` takes two collectives and pickles)."""
        mine = digest(value)
        sent = torch.zeros(1 + DIGEST_SIZE, dtype=torch.uint8)
        if mine is not None:
            sent[0] = 1
            sent[1:] = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
        out = torch.empty(self.world_size * (1 + DIGEST_SIZE), dtype=torch.uint8, device=self.device)
        all_gather_single(out, sent.to(self.device), group=self.group)
        return [bytes(row[1:].tolist()) if row[0] else None for row in out.cpu().view(self.world_size, -1)]

    def assert_equal_across_ranks(self, value: Any, what: str = "value") -> None:
        """Fail on every rank (not only on the odd one out) unless `value` is the same on all ranks.

        Ranks first exchange digests (one small all-gather); only when those differ, or a value has
        none, are the values gathered, compared with ``torch.equal`` or ``==``, and shown."""
        if isinstance(value, torch.Tensor):
            value = value.detach().cpu()
        every = self.digests(value)
        if every[0] is not None and every.count(every[0]) == len(every):
            return
        values = self.all_gather_object(value)
        first = values[0]
        same = [torch.equal(v, first) if isinstance(first, torch.Tensor) else v == first for v in values]
        if not all(same):
            detail = "\n".join(f"  rank {r}: {v!r}" for r, v in enumerate(values))
            raise AssertionError(f"{what} differs across ranks:\n{detail}")

    def record(self, key: str, value: Any) -> None:
        """Hand structured data (measured errors, counts) back to the parent's pytest item."""
        self._records.append((key, value))
