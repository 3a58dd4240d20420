"""The family sharding's instruments (conformance/measure/): the memory tracker counts what was
allocated under it exactly (frees, views, in-place results, FSDP's storage resize, DTensor's inner
tensors, storages from before never), splits it by kind; the collective counter's bytes sent follow
the ring formula; the promises fail a replicating footprint and pass a sharded one, naming numbers."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from conformance.measure import promises
from conformance.measure.footprint import traffic_table
from conformance.measure.memory import MemoryTracker
from conformance.measure.traffic import Collective, CollectiveCounter
from harness import distributed

KB = 1024


def test_counts_allocations_and_frees_not_views_or_what_came_before():
    before = torch.zeros(KB)  # allocated before the tracker: never counted
    with MemoryTracker("cpu") as mem:
        a = torch.zeros(KB)                       # 4 KiB
        view, _ = a.view(2, -1), a.add_(1)        # a view and an in-place result: no allocation
        b = before * 2                            # a new tensor from an old one: 4 KiB
        before.mul_(3)                            # in place on an old storage: nothing
        assert mem.live == 8 * KB and mem.peak == 8 * KB
        del a, view, _
        gc.collect()
        assert mem.live == 4 * KB and mem.peak == 8 * KB
        assert mem.mark() == 4 * KB and mem.peak == 4 * KB
    del b


def test_a_storage_resized_to_nothing_is_freed_and_counted_again_when_regrown():
    with MemoryTracker("cpu") as mem:
        t = torch.empty(KB)
        t.untyped_storage().resize_(0)            # how FSDP frees a gathered parameter
        assert mem.live == 0
        t.untyped_storage().resize_(4 * KB)
        assert mem.live == 4 * KB and mem.peak == 4 * KB
    assert torch.UntypedStorage.resize_ is not None and mem.live == 4 * KB  # the method is restored
    t.untyped_storage().resize_(0)
    assert mem.live == 4 * KB  # no longer listening


def test_kinds_split_parameters_gradients_optimizer_state_and_the_rest():
    with MemoryTracker("cpu") as mem:
        model = nn.Linear(16, 16, bias=False)      # 1 KiB of parameters
        buffer = torch.zeros(64)                   # 256 B of something else
        optimizer = torch.optim.Adam(model.parameters(), foreach=False)
        model(torch.ones(2, 16)).sum().backward()  # 1 KiB of gradients
        optimizer.step()                           # 2 KiB of moments and a step counter
        kinds = mem.kinds()
    assert kinds["parameters"] == KB and kinds["gradients"] == KB
    assert kinds["optimizer"] in (2 * KB, 2 * KB + 4)  # Adam's step counter comes from Python data: unseen
    assert kinds["other"] >= 256
    del buffer


def test_sent_bytes_follow_the_ring_formula():
    gather = Collective("all_gather", "_allgather_base_", 1000, "float32", (0, 1, 2, 3))
    reduce = Collective("all_reduce", "allreduce_", 1000, "float32", (0, 1))
    assert gather.sent == 750 and reduce.sent == 1000
    assert Collective("all_reduce", "allreduce_", 1000, "float32", (3,)).sent == 0


@distributed(world_size=2)  # on gloo at the dispatcher; on threaded by the tap on the group's methods
def test_counter_sees_c10d_collectives_with_dtype_volume_and_group(ctx):
    with CollectiveCounter() as counter:
        out = torch.empty(8)
        dist.all_gather_into_tensor(out, torch.ones(4))
        dist.all_reduce(torch.ones(3, dtype=torch.float64))
        dist.reduce_scatter_tensor(torch.empty(2, dtype=torch.bfloat16), torch.ones(4, dtype=torch.bfloat16))
        dist.barrier()
    dist.all_reduce(torch.ones(1))  # after the block: not counted
    table = traffic_table(counter)
    assert sorted(table) == ["all_gather", "all_reduce", "reduce_scatter"], table
    assert table["all_gather"]["volume"] == 32 and table["all_gather"]["sent"] == 16
    assert table["all_reduce"]["dtypes"] == ["float64"] and table["all_reduce"]["group_sizes"] == [2]
    assert table["reduce_scatter"]["dtypes"] == ["bfloat16"] and table["reduce_scatter"]["volume"] == 8
    assert [c.reduces_floats for c in counter.calls] == [False, True, True]


def _footprint(held, optimizer, gradients, forward, all_gather=0, reduce_scatter=0, all_reduce=0):
    traffic = {kind: {"sent": sent} for kind, sent in
               (("all_gather", all_gather), ("reduce_scatter", reduce_scatter), ("all_reduce", all_reduce)) if sent}
    return {"rest": {"total": held, "optimizer": optimizer, "parameters": 0, "gradients": 0, "other": 0},
            "gradients": gradients, "forward": forward, "backward": gradients, "peak": held, "traffic": traffic}


P = 1000.0
UNSHARDED = {**_footprint(3 * P, 2 * P, P, 50), "rest": {"total": 3 * P, "optimizer": 2 * P, "parameters": P,
                                                         "gradients": 0, "other": 0}}


def test_a_replicating_full_shard_fails_every_row_with_its_numbers():
    replicated = _footprint(3 * P, 2 * P, P, 50, all_reduce=P)  # DDP at 2 ranks: one all-reduce of P
    failures, figures = promises.judge("FULL_SHARD", 2, 1, replicated, UNSHARDED)
    assert [f.split(":")[0] for f in failures] == ["held between steps", "optimizer state",
                                                   "gradients after backward", "bytes sent per step"]
    assert "1.00x of unsharded at shard size 2; FULL_SHARD promises <= 0.82x" in failures[0]
    assert figures["rest"]["ratio"] == 1.0 and figures["sent"]["ratio"] == pytest.approx(2 / 3, abs=1e-3)


def test_sharded_full_shard_passes_and_keeping_the_gathered_model_fails():
    sharded = _footprint(1.5 * P, P, P / 2, 50, all_gather=P, reduce_scatter=P / 2)  # 3 x P x 1/2 sent
    assert promises.judge("FULL_SHARD", 2, 1, sharded, UNSHARDED)[0] == []
    kept = _footprint(1.5 * P, P, P / 2, 50 + P, all_gather=P / 2, reduce_scatter=P / 2)
    failures, _ = promises.judge("FULL_SHARD", 2, 1, kept, UNSHARDED)
    assert [f.split(":")[0] for f in failures] == ["gathered after forward", "bytes sent per step"]
    assert promises.judge("SHARD_GRAD_OP", 2, 1, kept, UNSHARDED)[0] == []  # its promise: kept until backward


def test_no_shard_promises_traffic_only_and_one_rank_promises_no_traffic():
    replicated = _footprint(3 * P, 2 * P, P, 50, all_reduce=P)
    assert promises.judge("NO_SHARD", 1, 2, replicated, UNSHARDED)[0] == []
    assert promises.sent_formula("NO_SHARD", P, 1, 2) == P
    assert promises.judge("FULL_SHARD", 1, 1, _footprint(3 * P, 2 * P, P, 50 + P), UNSHARDED)[0] == []


def _cell(impl, ws, strategy, held):
    figures = {"strategy": strategy, "rest": {"measured": held, "unsharded": 100}}
    return (impl, f"test_sharding[ws{ws}-{strategy}]"), {"world_size": ws, "footprint": figures}


def test_the_matrix_shows_memory_per_rank_against_world_size():
    from conformance.report import footprints

    cells = dict(_cell(impl, ws, "FULL_SHARD", held) for impl, ws, held in
                 (("a", 1, 100), ("a", 2, 50), ("a", 4, 25), ("b", 2, 100), ("b", 4, 100)))
    cells.update([_cell("a", 4, "NO_SHARD", 100), (("a", "test_other[ws2]"), {"world_size": 2, "footprint": None})])
    assert footprints.table(cells) == {"FULL_SHARD": {"a": {1: 1.0, 2: 0.5, 4: 0.25}, "b": {2: 1.0, 4: 1.0}},
                                       "NO_SHARD": {"a": {4: 1.0}}}
    lines = footprints.markdown(cells, "memory.svg")
    assert "![memory per rank against world size](memory.svg)" in lines
    assert "| FULL_SHARD | b | – | 1.00 | 1.00 |" in lines
    assert footprints.chart_svg(cells).lstrip().startswith("<?xml")


class ReplicatingFullShard:
    """A liar for simulate: the reference replicating (NO_SHARD: whole parameters, gradients and Adam
    state on every rank) under a FULL_SHARD label."""

    name, version = "replicating-full-shard", "0"
    capabilities = frozenset({"full_shard"})

    def trainer(self, model, spec, recipe):
        from conformance.adapters.reference import ReferenceAdapter
        from conformance.protocol import ShardSpec

        return ReferenceAdapter().trainer(model, ShardSpec(strategy="NO_SHARD", mesh=spec.mesh), recipe)


def test_simulate_any_adapter_through_its_trainer_at_a_large_world_size():
    """simulate's trainer path (conformance/simulate/trainers.py) at 256 ranks on the fake group:
    FSDP2 holds about 1/256 of unsharded training; the replicating liar holds all of it."""
    from conformance.simulate import trainers

    honest = trainers.simulate_rank("torch-fsdp2", 256, "tiny", 255)
    assert honest["figures"]["rest"]["ratio"] < 0.05 and honest["figures"]["optimizer"]["ratio"] < 0.05
    liar = trainers.simulate_rank(f"{__name__}:ReplicatingFullShard", 256, "tiny", 0)
    assert liar["figures"]["rest"]["ratio"] >= 1.0
    assert any(f.startswith("held between steps") for f in liar["failures"])
    with pytest.raises(ValueError, match="does not declare full_shard"):
        trainers.simulate("ddp", 8, "tiny")


def test_simulate_hybrid_shard_through_the_trainer_on_a_2d_mesh():
    from conformance.simulate import trainers

    rank = trainers.simulate_rank("torch-fsdp2", 64, "tiny", 63, mesh="2x32")
    figures = rank["figures"]
    assert (figures["strategy"], figures["shard_size"], figures["replicas"]) == ("HYBRID_SHARD", 32, 2)
    assert "all_reduce" in figures["sent"]["by_kind"]  # across the replicas
    assert figures["optimizer"]["ratio"] < 0.1
