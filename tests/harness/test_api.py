"""The test API, used directly: world sizes, parameters from pytest and from `parameterized`,
the per-rank context."""

import pytest
import torch
import torch.distributed as dist
from parameterized import parameterized

from shardcheck.harness import distributed


@distributed(world_size=[1, 2, 3])
@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_parametrize_reaches_every_rank(ctx, scale, world_size):
    assert ctx.world_size == world_size
    t = torch.full((1,), scale * ctx.rank, device=ctx.device)
    dist.all_reduce(t)
    assert t.item() == scale * sum(range(world_size))
    ctx.assert_equal_across_ranks(t, "reduced value")


class TestParameterized:
    @parameterized.expand([("two", 2.0), ("three", 3.0)])
    @distributed(world_size=2)
    def test_expand_in_a_class(self, ctx, _name, value):
        t = torch.full((1,), value)
        dist.all_reduce(t)
        assert t.item() == 2 * value


@parameterized.expand([(1,), (4,)])
@distributed(world_size=2)
def test_expand_on_a_function(ctx, value):
    assert ctx.all_gather_object(value * ctx.rank) == [0, value]


@distributed(world_size=4)
def test_mesh_is_cached_and_2d(ctx):
    mesh = ctx.mesh((2, 2), ("dp", "tp"))
    assert mesh is ctx.mesh((2, 2), ("dp", "tp"))
    t = torch.ones(1)
    dist.all_reduce(t, group=mesh.get_group("tp"))
    assert t.item() == 2


@distributed(world_size=2)
def test_seeded_sections_are_identical_on_every_rank(ctx):
    with ctx.seeded(7):
        a = torch.randn(4)
    ctx.assert_equal_across_ranks(a, "seeded tensor")


@distributed(world_size=[2, 3])
def test_ranks_see_what_a_launcher_gives(ctx):
    """RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE as torchrun sets them on one node (process
    modes; thread-mode ranks share one environment, so there they are not set per rank)."""
    import os

    if ctx.is_threaded:
        pytest.skip("thread-mode ranks share one process environment")
    if ctx.mode == "external":
        assert int(os.environ["WORLD_SIZE"]) >= ctx.world_size
        return
    assert os.environ["RANK"] == os.environ["LOCAL_RANK"] == str(ctx.rank)
    assert os.environ["WORLD_SIZE"] == os.environ["LOCAL_WORLD_SIZE"] == str(ctx.world_size)


@distributed(world_size=2)
def test_rank_processes_start_with_what_they_inherited_frozen(ctx):
    """A rank process freezes the objects it starts with (torch and the preloaded modules), so its
    full garbage collections skip them (shardcheck/harness/worker.py)."""
    import gc

    if ctx.mode not in ("pool", "spawn"):
        pytest.skip(f"{ctx.mode} ranks are not processes started by the harness")
    assert gc.get_freeze_count() > 10_000, gc.get_freeze_count()


@distributed(world_size=2)
def test_assert_equal_across_ranks_compares_values_where_digests_cannot(ctx):
    """Equal values whose bytes differ (0.0 and -0.0) or that have no digest are compared as values."""
    from fractions import Fraction

    ctx.assert_equal_across_ranks(torch.tensor([0.0 if ctx.rank == 0 else -0.0]), "signed zero")
    ctx.assert_equal_across_ranks(Fraction(1, 3), "an object without a digest")
    with pytest.raises(AssertionError, match="fraction differs across ranks"):
        ctx.assert_equal_across_ranks(Fraction(ctx.rank, 3), "fraction")
    assert ctx.digests((1, "x")) == ctx.digests((1, "x")) and ctx.digests(Fraction(1, 2)) == [None, None]


def test_a_chained_exception_is_headed_by_the_one_raised():
    """A check that re-raises with `from` (the dtype contract naming the boundary an operator then
    refused) is headed by its own line, not by the cause printed first."""
    from shardcheck.harness.verdict import summary_line

    try:
        try:
            raise RuntimeError("expected scalar type BFloat16 but found Float")
        except RuntimeError as exc:
            raise AssertionError("buffer norm.running_mean seen by forward in float32") from exc
    except AssertionError as exc:
        import traceback
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    assert summary_line(text) == "AssertionError: buffer norm.running_mean seen by forward in float32"
    assert summary_line("Traceback (most recent call last):\n  File 'x'\nValueError: one") == "ValueError: one"


@distributed(world_size=2, backend="threaded")
def test_a_collective_inside_a_seeded_block_fails_at_once_in_thread_mode(ctx):
    """Thread ranks share one RNG, so seeded blocks take turns: a collective there would wait forever
    for the ranks waiting for the block (DTensor's first random op on CUDA broadcasts a seed)."""
    from shardcheck.harness.context import SeededCollective

    with pytest.raises(SeededCollective, match=r"\(allreduce\) inside ctx.seeded in thread mode"):
        with ctx.seeded(0):
            dist.all_reduce(torch.ones(1))
