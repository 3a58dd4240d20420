"""`shardcheck simulate`: shard arithmetic at large world sizes, in one process (fake group, meta)."""
from __future__ import annotations

import json
import math

import pytest
import torch

from shardcheck.conformance.cli import exit_codes as codes
from shardcheck.conformance.cli import main as cli
from shardcheck.conformance.simulate import default_ranks, simulate, simulate_rank
from shardcheck.conformance.simulate import expected as E
from shardcheck.conformance.simulate import impls, shard_layouts, verdicts
from shardcheck.conformance.simulate.presets import build


def _torch_chunk_shape(shape, ws: int, rank: int) -> list[int]:
    """Independent of the simulator: what ``torch.chunk`` gives rank ``rank`` (it may return fewer
    than ``ws`` chunks; the ranks past the last chunk hold nothing)."""
    full = torch.empty(shape or [1], device="meta")
    chunks = torch.chunk(full, ws)
    return list(chunks[rank].shape) if rank < len(chunks) else [0, *full.shape[1:]]


@pytest.fixture(scope="module")
def tiny_shapes():
    return {n: list(p.shape) for n, p in build("tiny").named_parameters()}


@pytest.mark.parametrize("ws", [64, 1024])
def test_reference_shards_match_torch_chunk(ws, tiny_shapes):
    for rank in default_ranks(ws, "tiny"):
        result = simulate_rank("reference", ws, "tiny", rank)
        assert [c["outcome"] for c in result["cells"]] == ["passed"] * 3, result["cells"]
        assert {r["name"] for r in result["params"]} == set(tiny_shapes)
        bound = 0
        for row in result["params"]:
            shape = tiny_shapes[row["name"]]
            rows, row_numel = (shape[0], math.prod(shape[1:])) if shape else (1, 1)
            assert row["local_shape"] == _torch_chunk_shape(shape, ws, rank), row
            assert row["padded_rows"] == -(-rows // ws) - row["local_shape"][0], row
            assert row["bytes"] == row["local_shape"][0] * row_numel * 4
            bound += -(-rows // ws) * row_numel * 4
        assert result["totals"]["bound_bytes"] == bound
        assert result["totals"]["storage_bytes"] <= bound


def test_last_rank_of_1024_holds_nothing_of_small_params():
    last = simulate_rank("reference", 1024, "tiny", 1023, step=False)
    assert all(r["local_shape"][0] == 0 for r in last["params"])  # every tiny dim is < 1024 rows
    assert last["totals"]["storage_bytes"] == 0 and last["collectives"] is None


def test_collectives_follow_the_unit_formula():
    result = simulate_rank("reference", 64, "tiny", 0)
    units = E.units_of(build("tiny"), 64)
    per_unit = [64 * sum(-(-p["rows"] // 64) * p["row_numel"] * 4 for p in u) for u in units]
    expected = {"count": len(units), "bytes": sum(per_unit), "groups": ["0..63 step 1"]}
    assert result["collectives"] == {"all_gather": expected, "reduce_scatter": expected}


def test_wrong_expectations_are_reported_failed():
    result = simulate_rank("reference", 64, "tiny", 63)
    units = E.units_of(build("tiny"), 64)
    floor_rows = [dict(E.expected_row(p, 64, 63), local_shape=[p["rows"] // 64, *p["shape"][1:]])
                  for u in units for p in u]
    assert verdicts.sharded_dim0(result["params"], floor_rows, 63)["outcome"] == "failed"
    halved = [dict(E.expected_row(p, 64, 0), bound_bytes=0) for u in units for p in u]
    assert verdicts.bytes_within_ceil_bound(
        simulate_rank("reference", 64, "tiny", 0, step=False)["params"], halved, 0)["outcome"] == "failed"
    extra = {k: {"count": v["count"] + 1, "bytes": v["bytes"]} for k, v in result["collectives"].items()}
    cell = verdicts.collectives_per_step(result["collectives"], extra, 63)
    assert cell["outcome"] == "failed" and "all_gather" in cell["detail"][0]


def test_wrong_design_formula_fails_the_run(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(impls.ReferenceSim, "gathers_per_unit", 2)  # claims a backward re-gather
    out = tmp_path / "sim.json"
    code = cli.main(["simulate", "--world-size", "1024", "--model", "tiny", "--rank", "0", "-o", str(out)])
    report = json.loads(out.read_text())
    assert code == 1 and report["summary"] == {"passed": 2, "failed": 1}
    assert [c["check"] for c in report["cells"] if c["outcome"] == "failed"] == ["collectives_per_step"]
    assert "FAILED collectives_per_step" in capsys.readouterr().out


def test_cli_writes_a_passing_report(tmp_path):
    out = tmp_path / "sim.json"
    assert cli.main(["simulate", "--impl", "reference", "--world-size", "64", "--model", "tiny", "-o", str(out)]) == 0
    report = json.loads(out.read_text())
    # tiny at 64: rows 24 | 72 | 37 | 101 cut the shard ranks at 24, 36, 37, 50 and 51
    classes = [[0, 23], [24, 35], [36, 36], [37, 49], [50, 50], [51, 63]]
    assert [c["shard_ranks"] for c in report["classes"]] == classes
    assert report["target"]["world_size"] == 64 and report["target"]["mesh"] == [64]
    assert report["target"]["ranks"] == sorted({r for c in classes for r in c})
    assert {c["check"] for c in report["cells"]} == {"every_param_sharded_dim0", "bytes_per_rank_within_ceil_bound",
                                                    "collectives_per_step", "every_rank_by_class"}
    assert report["summary"]["failed"] == 0 and report["step_ranks"] == [c[0] for c in classes]


@pytest.mark.parametrize("argv, message, code", [
    (["--model", "nope"], "unknown model preset 'nope'", codes.UNKNOWN_NAME),
    (["--impl", "nope"], "unknown implementation 'nope'", codes.UNKNOWN_NAME),
    (["--impl", "ddp"], "ddp does not declare full_shard: nothing to simulate through its trainer", codes.USAGE),
    (["--rank", "64"], "rank 64 is outside world size 64", codes.USAGE),
    (["--mesh", "4x8"], "mesh 4x8 has 32 ranks, not the world size 64", codes.USAGE),
    (["--mesh", "8by8"], "mesh must be REPLICATExSHARD", codes.USAGE),
])
def test_bad_input_is_one_line(argv, message, code, capsys):
    assert cli.main(["simulate", "--world-size", "64", "--model", "tiny", *argv]) == code
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_torch_fsdp2_sharding_at_init_matches_torch_chunk():
    report = simulate("torch-fsdp2", 64, "tiny", step="first")
    ranks = len(report["target"]["ranks"])
    assert report["summary"] == {"passed": 2 * ranks + 2, "failed": 0}, shard_layouts.human_summary(report)
    assert report["step_ranks"] == [0]


@pytest.mark.filterwarnings("ignore:.*is deprecated:FutureWarning")  # the older names also run on torch 2.9
def test_the_fake_world_issues_gathers_without_moving_bytes():
    """At 16,384 ranks torch's fake group would copy the input into every chunk of an all-gather's
    output; the fake world answers all-gathers and reduce-scatters into a tensor at the dispatcher
    instead: the output keeps what it held, and the collective is still counted, whole."""
    import torch.distributed as dist

    from shardcheck.conformance.measure.traffic import CollectiveCounter
    from shardcheck.conformance.simulate.fake_group import fake_world

    world = 16384
    with fake_world(3, world), CollectiveCounter() as counter:
        gathered = torch.full((world * 4,), -1.0)
        dist.all_gather_into_tensor(gathered, torch.ones(4))
        shard = torch.full((4,), -2.0)
        dist.reduce_scatter_tensor(shard, torch.ones(world * 4))
        summed = torch.ones(2)
        dist.all_reduce(summed)
        objects = [None] * world
        dist.all_gather_object(objects, {"rank": 3})  # list outputs: filled, as torch's fake group
    assert torch.equal(gathered, torch.full((world * 4,), -1.0)) and torch.equal(shard, torch.full((4,), -2.0))
    assert objects[0] == objects[-1] == {"rank": 3}
    kinds = counter.by_kind(describe=len)
    assert kinds["all_gather"]["count"] >= 1 and kinds["reduce_scatter"] == {"count": 1, "bytes": world * 16, "groups": [world]}
    assert any(c.kind == "all_gather" and c.volume == world * 16 and len(c.ranks) == world for c in counter.calls)


def _fsdp2_step(world: int, mesh: str | None, meta_buffers: bool, reshard: bool = True):
    """FSDP2 sharded by the layouts path's simulator on rank 0, then one step: through the simulator
    (padded buffers on meta), or as FSDP2 runs by default (its buffers on the CPU). Returns the
    collectives by kind, their expectation, and the CPU bytes the step held at its peak."""
    from shardcheck.conformance.measure.memory import MemoryTracker
    from shardcheck.conformance.measure.traffic import CollectiveCounter
    from shardcheck.conformance.simulate.fake_group import fake_world

    sim, shape = impls.TorchFSDP2Sim(), E.Mesh.parse(mesh, world)
    with fake_world(0, world):
        model = build("llama-tiny" if mesh else "tiny")
        sim.shard(model, shape)
        if not reshard:
            model.set_reshard_after_forward(False)  # a different engine: each unit gathered once
        with MemoryTracker(torch.device("cpu")) as memory:
            if meta_buffers:
                counter = sim.step(model)
            else:
                model.to_empty(device="cpu")
                with CollectiveCounter() as counter:
                    model(model.example_input("cpu")).float().sum().backward()
        expected = sim.expected(E.units_of(build("llama-tiny" if mesh else "tiny"), shape.shard), shape, 0)
        return counter.by_kind(E.describe_ranks), expected, memory.peak


@pytest.mark.filterwarnings("ignore:.*is deprecated:FutureWarning")
@pytest.mark.parametrize("world, mesh", [(64, None), (8, "2x4")])
def test_fsdp2_steps_with_its_padded_buffers_on_meta(world, mesh):
    """The layouts path gathers FSDP2's units into meta storage (as the reference's simulator does):
    FSDP2 issues the same collectives, calls, bytes and groups, as with its default buffers on the
    CPU, while the CPU holds only the rank's shards and their gradients (no gathered unit, no padded
    gradient); and an engine that gathers otherwise is still seen by the verdict."""
    from shardcheck.conformance.simulate.processes import each_in_own_process

    # in children, as simulate runs them: an autograd backward in pytest's process would leave the
    # engine's threads behind, and later tests fork (torch 2.14 refuses autograd in such a child)
    results = each_in_own_process(_fsdp2_step, [(world, mesh, True), (world, mesh, False), (world, mesh, True, False)], 2)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    (meta, expected, meta_peak), (cpu, _, cpu_peak), (once, _, _) = results
    assert meta == cpu and verdicts.collectives_per_step(meta, expected, 0)["outcome"] == "passed"
    shards = expected["reduce_scatter"]["bytes"] // (world // (2 if mesh else 1))  # the rank's padded shards
    gathered = expected["all_gather"]["bytes"] // expected["all_gather"]["count"]  # a unit gathered, on average
    assert meta_peak <= 2 * shards and cpu_peak >= meta_peak + gathered, (meta_peak, shards, cpu_peak, gathered)
    assert once["all_gather"]["count"] < expected["all_gather"]["count"]
    assert verdicts.collectives_per_step(once, expected, 0)["outcome"] == "failed"
