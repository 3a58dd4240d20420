"""The family sharding's instruments (shardcheck/conformance/measure/): the memory tracker counts what was
allocated under it exactly (frees, views, in-place results, FSDP's storage resize, DTensor's inner
tensors, storages from before never), splits it by kind; the collective counter's bytes sent follow
the ring formula; the promises fail a replicating footprint and pass a sharded one, naming numbers."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from shardcheck.conformance.measure import promises
from shardcheck.conformance.measure.footprint import traffic_table
from shardcheck.conformance.measure.memory import MemoryTracker
from shardcheck.conformance.measure.traffic import Collective, CollectiveCounter
from shardcheck.harness import distributed

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


@distributed(world_size=2)
def test_gathered_bytes_are_all_gather_outputs_and_their_copies_counted_gross(ctx):
    if ctx.is_threaded:
        pytest.skip("the threaded group's collectives pass no dispatcher op: the tracker sees gloo's")
    with MemoryTracker("cpu") as mem:
        shard = torch.ones(KB)                                   # 4 KiB, never gathered
        mem.mark()
        full = torch.empty(2 * KB)
        dist.all_gather_into_tensor(full, shard)                 # 8 KiB gathered
        cast = full.to(torch.float64)                            # a copy of gathered bytes: 16 KiB gathered
        product = full * 2                                       # computed from them: not gathered
        assert mem.gathered_live == 24 * KB and mem.gathered_since(mem.epoch) == 24 * KB
        del cast
        gc.collect()
        assert mem.gathered_live == 8 * KB and mem.gathered_peak == 24 * KB  # gross, at its moment
        full.untyped_storage().resize_(0)                        # freed as FSDP frees it
        assert mem.gathered_live == 0
        mem.mark()
        assert mem.gathered_peak == 0 and mem.gathered_since(mem.epoch) == 0
    del product


P = 1_000_000.0  # parameter bytes: large beside the bounds' constant (promises.SMALL)


def _footprint(held, optimizer, gradients, kept=0, gathered=P / 8, all_gather=0, reduce_scatter=0,
               all_reduce=0, peak=None):
    traffic = {kind: {"sent": sent} for kind, sent in
               (("all_gather", all_gather), ("reduce_scatter", reduce_scatter), ("all_reduce", all_reduce)) if sent}
    return {"rest": {"total": held, "optimizer": optimizer, "parameters": 0, "gradients": 0, "other": 0},
            "gradients": gradients, "forward": 50, "kept": kept, "gathered": {"forward": gathered, "backward": gathered},
            "backward": gradients, "peak": P / 2 if peak is None else peak, "traffic": traffic}


UNSHARDED = {**_footprint(3 * P, 2 * P, P, gathered=0, peak=2 * P),
             "rest": {"total": 3 * P, "optimizer": 2 * P, "parameters": P, "gradients": 0, "other": 0}}


def _shapes(n: int) -> promises.Shapes:
    """Eight equal units of P/8, nothing in the root, every size divisible by n."""
    return promises.Shapes(parameter_bytes=int(P), root_bytes=0, gathered_root_bytes=0,
                           largest_unit_bytes=int(P / 8), shard_bytes=int(P / n))


def _broken(failures) -> list[str]:
    return [f.split(":")[0] for f in failures]


def test_a_replicating_full_shard_fails_every_memory_row_and_the_traffic_by_kind():
    replicated = _footprint(3 * P, 2 * P, P, gathered=0, all_reduce=P)  # DDP at 2 ranks: one all-reduce of P
    failures, figures = promises.judge("FULL_SHARD", 2, 1, replicated, UNSHARDED, _shapes(2))
    assert _broken(failures) == ["held between steps", "optimizer state", "gradients after backward", "held after backward",
                                 "all_gather bytes sent", "reduce_scatter bytes sent", "all_reduce bytes sent"]
    assert figures["rows"]["held between steps"][1] == 4 * P / 2 + promises.SMALL  # [measured, bound]
    assert "all_reduce bytes sent: 976.6 KiB per step (1.00x of the parameters); FULL_SHARD on 2 shards " \
           "promises <= 4.0 KiB (0.00x)" in failures[-1]


def test_sharded_full_shard_passes_and_each_liar_fails_its_row():
    sent = {"all_gather": P, "reduce_scatter": P / 2}  # (2P) (n-1)/n and P (n-1)/n at n = 2
    sharded = _footprint(1.5 * P, P, P / 2, **sent)
    assert promises.judge("FULL_SHARD", 2, 1, sharded, UNSHARDED, _shapes(2))[0] == []
    liars = {  # what each broke, as measured
        "kept gathered after forward": _footprint(1.5 * P, P, P / 2, kept=2 * P / 8, **sent),
        "gathered during forward": {**sharded, "gathered": {"forward": P, "backward": P / 8}},
        "held between steps": _footprint(1.5 * P + P, P, P / 2, **sent),
        "all_gather bytes sent": _footprint(1.5 * P, P, P / 2, all_gather=1.5 * P, reduce_scatter=P / 2),
    }
    for row, liar in liars.items():
        assert _broken(promises.judge("FULL_SHARD", 2, 1, liar, UNSHARDED, _shapes(2))[0]) == [row], row
    kept = liars["kept gathered after forward"]
    assert promises.judge("SHARD_GRAD_OP", 2, 1, {**kept, "traffic": {"all_gather": {"sent": P / 2},
                                                                     "reduce_scatter": {"sent": P / 2}}},
                          UNSHARDED, _shapes(2))[0] == []  # its promise: kept until backward


def test_no_shard_and_one_rank_are_judged_against_unsharded_training():
    replicated = _footprint(3 * P, 2 * P, P, gathered=0, all_reduce=P, peak=2 * P)
    assert promises.judge("NO_SHARD", 1, 2, replicated, UNSHARDED, _shapes(1))[0] == []
    assert promises.sent_formulas("NO_SHARD", P, 1, 2)["all_reduce"] == P
    one = _footprint(3 * P, 2 * P, P, gathered=0, peak=2 * P)
    assert promises.judge("FULL_SHARD", 1, 1, one, UNSHARDED, _shapes(1))[0] == []
    bucket = _footprint(3 * P, 2 * P, P, gathered=0, peak=2 * P + 30000 * P)  # DeepSpeed's 2 GB bucket
    assert _broken(promises.judge("SHARD_GRAD_OP", 1, 1, bucket, UNSHARDED, _shapes(1))[0]) == ["peak during the step"]


def test_shard_optimizer_shards_the_optimizer_state_alone_and_redistributes_the_parameters():
    """ZeRO-1 at 2 ranks: half the optimizer state, parameters and gradients whole, one all-reduce of
    the gradients and P/2 sent redistributing the parameters (a broadcast from each owner, as torch's
    ZeroRedundancyOptimizer does, or an all-gather). DDP with a plain Adam under the same name fails."""
    def zero1(held, optimizer, **sent):
        return {**_footprint(held, optimizer, P, gathered=0, peak=2 * P),
                "traffic": {kind: {"sent": v} for kind, v in sent.items()}}

    assert promises.sent_formulas("SHARD_OPTIMIZER", P, 2, 1) == {"all_gather": P / 2, "reduce_scatter": 0.0,
                                                                  "all_reduce": P}
    for redistribution in ("broadcast", "all_gather"):
        good = zero1(2 * P, P, all_reduce=P, **{redistribution: P / 2})
        assert promises.judge("SHARD_OPTIMIZER", 2, 1, good, UNSHARDED, _shapes(2))[0] == [], redistribution
    imposter = zero1(3 * P, 2 * P, all_reduce=P)  # DDP + Adam: the whole state, nothing redistributed
    failures, figures = promises.judge("SHARD_OPTIMIZER", 2, 1, imposter, UNSHARDED, _shapes(2))
    assert _broken(failures) == ["optimizer state", "all_gather or broadcast bytes sent"]
    assert figures["rows"]["optimizer state"][1] == P + promises.SMALL
    twice = zero1(2 * P, P, all_reduce=P, broadcast=P / 2, all_gather=P / 2)  # redistributed twice
    assert _broken(promises.judge("SHARD_OPTIMIZER", 2, 1, twice, UNSHARDED, _shapes(2))[0]) == [
        "all_gather or broadcast bytes sent"]
    sharded_grads = zero1(2 * P, P, all_reduce=P, broadcast=P / 2, reduce_scatter=P / 2)  # ZeRO-2's traffic
    assert _broken(promises.judge("SHARD_OPTIMIZER", 2, 1, sharded_grads, UNSHARDED, _shapes(2))[0]) == [
        "reduce_scatter bytes sent"]


def test_no_sharding_cell_passes_without_a_promise():
    """Every cell of the family sharding (each strategy at world sizes 1, 2 and 4, the hybrid mesh)
    is judged by memory rows and by traffic rows: none can pass asserting nothing."""
    cells = [(s, *(((1, w) if s == "NO_SHARD" else (w, 1))))
             for s in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "SHARD_OPTIMIZER") for w in (1, 2, 4)]
    for strategy, n, r in cells + [("HYBRID_SHARD", 2, 2)]:
        names = {row.name for row in promises.rows(strategy, n, r, UNSHARDED, UNSHARDED, _shapes(n))}
        assert {"held between steps", "optimizer state", "gradients after backward", "peak during the step"} <= names
        gather = "all_gather or broadcast" if strategy == "SHARD_OPTIMIZER" else "all_gather"
        assert {f"{k} bytes sent" for k in (gather, "reduce_scatter", "all_reduce")} <= names, (strategy, n, r)


def test_shapes_pad_each_layout_to_the_shard_count():
    model = nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 3))  # weights of 5 and 3 rows, biases of 5 and 3
    shapes = promises.Shapes.of(model, ("1",), 2)
    per_row = {"root": (3 * 4 + 3) * 4, "unit": (2 * 5 + 2) * 4}  # ceil(rows / 2) rows of each parameter
    assert shapes.parameter_bytes == (25 + 18) * 4
    assert shapes.root_bytes == 25 * 4 and shapes.gathered_root_bytes == 2 * per_row["root"]  # as gathered: padded
    assert shapes.largest_unit_bytes == 2 * per_row["root"]
    assert shapes.shard_bytes == max(sum(per_row.values()), (13 + 9) * 4) == sum(per_row.values())


def _cell(impl, ws, strategy, held):
    figures = {"strategy": strategy, "rest": {"measured": held, "unsharded": 100}}
    return (impl, f"test_sharding[ws{ws}-{strategy}]"), {"world_size": ws, "footprint": figures}


def test_the_matrix_shows_memory_per_rank_against_world_size():
    from shardcheck.conformance.report import footprints

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
        from shardcheck.conformance.adapters.reference import ReferenceAdapter
        from shardcheck.conformance.protocol import ShardSpec

        return ReferenceAdapter().trainer(model, ShardSpec(strategy="NO_SHARD", mesh=spec.mesh), recipe)


def test_simulate_any_adapter_through_its_trainer_at_a_large_world_size():
    """simulate's trainer path (shardcheck/conformance/simulate/trainers.py) at 256 ranks on the fake group:
    FSDP2 holds about 1/256 of unsharded training; the replicating liar holds all of it."""
    from shardcheck.conformance.simulate import trainers

    honest = trainers.simulate_rank("torch-fsdp2", 256, "tiny", 255)
    held = honest["figures"]["rows"]["held between steps"]
    assert honest["failures"] == [] and held[1] - promises.SMALL < 0.05 * honest["figures"]["rest"]["unsharded"]
    liar = trainers.simulate_rank(f"{__name__}:ReplicatingFullShard", 256, "tiny", 0)
    assert liar["figures"]["rest"]["ratio"] >= 1.0
    assert any(f.startswith("held between steps") for f in liar["failures"])
    with pytest.raises(ValueError, match="does not declare full_shard"):
        trainers.simulate("ddp", 8, "tiny")


def test_simulate_hybrid_shard_through_the_trainer_on_a_2d_mesh():
    from shardcheck.conformance.simulate import trainers

    rank = trainers.simulate_rank("torch-fsdp2", 64, "tiny", 63, mesh="2x32")
    figures = rank["figures"]
    assert (figures["strategy"], figures["shard_size"], figures["replicas"]) == ("HYBRID_SHARD", 32, 2)
    assert "all_reduce" in figures["sent"]["by_kind"]  # across the replicas
    assert figures["optimizer"]["measured"] < 0.1 * figures["optimizer"]["unsharded"] and rank["failures"] == []


class MaterializesWhole(ReplicatingFullShard):
    """A liar for the meta build: declares meta_init, then materializes the whole model on the CPU
    before sharding it (what an engine does that cannot shard a meta model)."""

    name = "materializes-whole"
    capabilities = frozenset({"full_shard", "meta_init"})

    def trainer(self, model, spec, recipe):
        from shardcheck.conformance.adapters.reference import ReferenceAdapter

        return ReferenceAdapter().trainer(model.to_empty(device="cpu"), spec, recipe)


@pytest.mark.parametrize("name", ["reference", "torch-fsdp2", "torch-fsdp1"])
def test_simulate_builds_on_meta_and_materializes_only_the_shards(name):
    """A meta_init adapter is handed the model on meta: while its trainer is made, no more than one
    unit whole (FSDP1 materializes unit by unit) and the rank's shards are alive (a row of its
    verdict); an adapter that materializes the whole model fails that row."""
    from shardcheck.conformance.simulate import trainers

    rank = trainers.simulate_rank(name, 64, "tiny", 0)
    p = rank["figures"]["parameter_bytes"]
    assert rank["built_on"] == "meta" and rank["failures"] == []
    assert rank["construction_bytes"] < p, (rank["construction_bytes"], p)
    whole = trainers.simulate_rank(f"{__name__}:MaterializesWhole", 8, "tiny", 0)  # little padding at 8
    assert whole["built_on"] == "meta" and whole["construction_bytes"] >= p
    assert [f for f in whole["failures"] if f.startswith("built on meta: ")], whole["failures"]
