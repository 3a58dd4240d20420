"""shardcheck's harness: run one test body on N ranks (pool, spawn, thread or external launch).

It knows nothing about FSDP. In a test module::

    from harness import distributed

    @distributed(world_size=[2, 4])
    def test_all_reduce(ctx):
        t = torch.ones(1) * ctx.rank
        dist.all_reduce(t)
        assert t.item() == sum(range(ctx.world_size))
"""

from harness.context import RankContext
from harness.plan import HarnessUsageError
from harness.runner import run
from harness.verdict import Verdict
from harness.vocabulary import BACKENDS

__all__ = ["BACKENDS", "HarnessUsageError", "RankContext", "Verdict", "distributed", "run"]


def distributed(world_size=2, *, backend=None, timeout=None):
    """Mark a test to run on `world_size` ranks (an int, or a list: one pytest item per size).

    `backend` fixes the backend for this test (default: the session's --backend); `timeout` is the
    per-test deadline in seconds (default: pytest-timeout's marker/option, else --rank-timeout).
    """
    import pytest

    return pytest.mark.distributed(world_size=world_size, backend=backend, timeout=timeout)
