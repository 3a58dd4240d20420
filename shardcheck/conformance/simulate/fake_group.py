"""One process plays rank ``r`` of ``N``: torch's *fake* process group, without torch.testing.

torch ships the fake backend in C++ (``torch._C._distributed_c10d.FakeProcessGroup``) and lists
``"fake"`` among ``dist.Backend``'s names, but only torch's private testing helpers (``fake_pg``)
register its creator.  We register the same creator through the public
``dist.Backend.register_backend`` (if nobody did yet) and use a plain ``dist.HashStore``.  Every
collective on the fake group returns at once and leaves its output untouched: shapes, dtypes and
call sequences are real, data is meaningless.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch.distributed as dist
from torch._C._distributed_c10d import FakeProcessGroup


def _create_fake_backend(common_opts, backend_opts):
    return FakeProcessGroup._create_internal(common_opts.group_rank, common_opts.group_size, backend_opts)


def register_fake_backend() -> None:
    if "FAKE" not in dist.Backend._plugins:
        dist.Backend.register_backend("fake", _create_fake_backend, extended_api=True,
                                      devices=["cpu", "cuda", "meta"])


@contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[None]:
    """The default process group is a fake group of ``world_size`` in which we are ``rank``."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world size {world_size}")
    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised; simulate in a fresh process")
    register_fake_backend()
    dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
