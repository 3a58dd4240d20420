"""The collective counter heard through the collective ops' own kernels
(shardcheck/conformance/measure/collective_ops.py) hears what it heard as a dispatch mode on top of
the stack: every c10d and functional collective, whoever issued it (the Python API, DTensor, DDP's
C++ reducer), in no_grad and inference_mode, the outermost only, never a compiled function's tracing;
and its kernels are registered only while some counter listens."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.utils._python_dispatch import TorchDispatchMode

from shardcheck.conformance.measure.memory import MemoryTracker
from shardcheck.conformance.measure.traffic import CollectiveCounter
from shardcheck.harness import distributed

ON_THREADS = "the threaded group's collectives pass no dispatcher op (the counter taps its methods there)"


class PassThrough(TorchDispatchMode):
    """A dispatch mode that does not say it runs every op (it could answer a collective itself)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _workload(ctx) -> None:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    out = torch.empty(8)
    dist.all_gather_into_tensor(out, torch.ones(4))
    dist.all_reduce(torch.ones(3, dtype=torch.float64))
    dist.reduce_scatter_tensor(torch.empty(2, dtype=torch.bfloat16), torch.ones(4, dtype=torch.bfloat16))
    dist.broadcast(torch.ones(5), src=0)
    funcol.all_reduce(torch.ones(6), "sum", dist.group.WORLD).add_(0)  # its c10d call inside: not again
    with torch.no_grad():
        dist.all_reduce(torch.ones(7))
    with torch.inference_mode():
        dist.all_reduce(torch.ones(9))
    mesh = ctx.mesh()
    distribute_tensor(torch.arange(8.0), mesh, [Shard(0)]).redistribute(mesh, [Replicate()]).to_local()
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))  # broadcasts its state
    model(torch.ones(3, 4)).sum().backward()  # the reducer's all-reduce, from C++


def _heard(calls) -> list[tuple]:
    return [(c.kind, c.op, c.volume, c.dtype, c.ranks) for c in calls]


@distributed(world_size=2)
def test_the_op_kernels_hear_what_a_mode_on_top_of_the_stack_hears(ctx):
    if ctx.is_threaded:
        pytest.skip(ON_THREADS)
    with CollectiveCounter() as by_kernels:
        assert by_kernels._listening is not None, "no dispatch mode was active: the kernels should listen"
        _workload(ctx)
    with PassThrough(), CollectiveCounter() as by_mode:
        assert by_mode._listening is None, "a mode that may answer collectives is below: go as a mode on top"
        _workload(ctx)
    with MemoryTracker("cpu"), CollectiveCounter() as under_tracker:
        assert under_tracker._listening is not None, "the memory tracker runs every op: listen below it"
        _workload(ctx)
    assert _heard(by_kernels.calls) == _heard(by_mode.calls) == _heard(under_tracker.calls)
    kinds = [c.op for c in by_kernels.calls]
    assert kinds.count("all_reduce") == 1, kinds  # the functional one, once, not its c10d call again
    assert [c.volume for c in by_kernels.calls if c.op == "allreduce_"][:3] == [24, 28, 36], kinds
    assert "all_gather_into_tensor" in kinds and kinds[-1] == "allreduce_", kinds  # DTensor's; DDP's reducer


@distributed(world_size=2)
def test_the_kernels_listen_only_while_a_counter_is_open(ctx):
    if ctx.is_threaded:
        pytest.skip(ON_THREADS)

    def registered() -> bool:
        return torch._C._dispatch_has_kernel_for_dispatch_key("c10d::allreduce_", "BackendSelect")

    assert not registered()
    with CollectiveCounter() as outer:
        with CollectiveCounter() as inner:
            dist.all_reduce(torch.ones(2))
        assert registered(), "the outer counter still listens"
        dist.all_reduce(torch.ones(3))
    assert not registered()
    dist.all_reduce(torch.ones(4))
    assert [c.volume for c in inner.calls] == [8] and [c.volume for c in outer.calls] == [8, 12]


@distributed(world_size=2)
def test_a_compiled_collective_is_heard_each_call_and_never_while_traced(ctx):
    if ctx.is_threaded:
        pytest.skip(ON_THREADS)
    group = dist.group.WORLD

    @torch.compile(backend="eager", fullgraph=True)
    def reduced(x):
        return funcol.all_reduce(x * 2, "sum", group)

    with CollectiveCounter() as counter:
        for _ in range(2):
            assert torch.equal(reduced(torch.ones(4)), torch.full((4,), 4.0))
    assert [(c.kind, c.volume) for c in counter.calls] == [("all_reduce", 16)] * 2
