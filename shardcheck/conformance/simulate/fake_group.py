"""One process plays rank ``r`` of ``N``: torch's *fake* process group, without torch.testing.

torch ships the fake backend in C++ (``torch._C._distributed_c10d.FakeProcessGroup``) and lists
``"fake"`` among ``dist.Backend``'s names, but only torch's private testing helpers (``fake_pg``)
register its creator.  We register the same creator through the public
``dist.Backend.register_backend`` (if nobody did yet) and use a plain ``dist.HashStore``.  Every
collective on the fake group returns at once: shapes, dtypes and call sequences are real, data is
meaningless.

The fake group still fills its outputs: an all-gather copies its input into each of the N chunks
of its output, a reduce-scatter copies chunk ``r`` of its input; at N = 16,384 that is 16,384
copies per all-gather and every gathered byte written. ``SilentCollectives`` answers those two
(tensor in, tensor out) at the dispatcher instead, leaving the output as it was: the collective is
still issued and seen by every dispatch mode entered later (shardcheck/conformance/measure counts
it there, with its sizes and group), only no byte moves.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Iterator

import torch.distributed as dist
from torch._C._distributed_c10d import FakeProcessGroup, _create_work_from_future
from torch.futures import Future
from torch.utils._python_dispatch import TorchDispatchMode

# c10d ops (tensor output, tensor input) whose output the fake group would fill, -> what they return
_SILENCED = {"_allgather_base_": "output_and_work", "_reduce_scatter_base_": "output_and_work",
             "allgather_into_tensor_coalesced_": "work", "reduce_scatter_tensor_coalesced_": "work"}


def _create_fake_backend(common_opts, backend_opts):
    return FakeProcessGroup._create_internal(common_opts.group_rank, common_opts.group_size, backend_opts)


def register_fake_backend() -> None:
    if "FAKE" not in dist.Backend._plugins:
        dist.Backend.register_backend("fake", _create_fake_backend, extended_api=True,
                                      devices=["cpu", "cuda", "meta"])


def _finished_work():
    future = Future()
    future.set_result(None)
    return _create_work_from_future(future).boxed()  # the op schema's Work (a torchbind object)


class SilentCollectives(TorchDispatchMode):
    """All-gathers and reduce-scatters into a tensor return at once with their output untouched."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        returns = _SILENCED.get(func._schema.name.split("::")[-1]) if func.namespace == "c10d" else None
        if returns == "output_and_work":
            return args[0], _finished_work()
        if returns == "work":
            return _finished_work()
        return func(*args, **(kwargs or {}))


@contextmanager
def fake_world(rank: int, world_size: int, silent: bool = True) -> Iterator[None]:
    """The default process group is a fake group of ``world_size`` in which we are ``rank``; with
    ``silent``, its all-gathers and reduce-scatters into a tensor leave their outputs untouched
    throughout (``SilentCollectives``). Without it, a caller silences only where collectives run:
    the mode costs every operation something, and sharding at 16,384 ranks is millions of operations
    (FINDINGS F68; the figures: docs/speed.md)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world size {world_size}")
    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised; simulate in a fresh process")
    register_fake_backend()
    dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=world_size)
    try:
        with SilentCollectives() if silent else nullcontext():
            yield
    finally:
        dist.destroy_process_group()
