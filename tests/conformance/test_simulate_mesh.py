"""`shardcheck simulate` on a 2-D (replicate, shard) mesh, classes of alike ranks, the llama presets."""
from __future__ import annotations

import json

import pytest
import torch

from shardcheck.conformance.cli import main as cli
from shardcheck.conformance.simulate import expected as E
from shardcheck.conformance.simulate import shard_layouts, simulate, simulate_rank, verdicts
from shardcheck.conformance.simulate.presets import build


def _torch_chunk_rows(rows: int, ws: int, rank: int) -> int:
    """Independent of expected.py: the rows ``torch.chunk`` gives ``rank`` (0 past the last chunk)."""
    chunks = torch.chunk(torch.empty(rows, device="meta"), ws)
    return chunks[rank].shape[0] if rank < len(chunks) else 0


def test_llama3_405b_has_llama_3_405b_dimensions():
    model = build("llama3-405b")
    params = dict(model.named_parameters())
    assert sum(p.numel() for p in params.values()) == 405_853_388_800  # Llama 3.1 405B's count
    assert len(params) == 126 * 9 + 3 and len(model.blocks) == 126
    b = model.blocks[0]
    assert [tuple(getattr(b, n).weight.shape) for n in ("wq", "wk", "wv", "wo", "w1", "w3", "w2")] == [
        (16384, 16384), (1024, 16384), (1024, 16384), (16384, 16384), (53248, 16384), (53248, 16384), (16384, 53248)]
    assert params["embed.weight"].shape == params["head.weight"].shape == (128256, 16384)  # untied
    assert params["norm.weight"].shape == b.attention_norm.weight.shape == (16384,)


@pytest.mark.parametrize("model", ["tiny", "llama-tiny"])
@pytest.mark.parametrize("shard", [1, 2, 5, 7, 24, 37, 64, 150])
def test_rank_classes_match_brute_force(model, shard):
    rows = [p.shape[0] if p.dim() else 1 for p in build(model).parameters()]
    signature = [tuple(_torch_chunk_rows(n, shard, s) for n in rows) for s in range(shard)]
    brute, start = [], 0
    for s in range(1, shard + 1):
        if s == shard or signature[s] != signature[start]:
            brute.append((start, s))
            start = s
    layouts = [p for u in E.units_of(build(model), shard) for p in u]
    assert E.rank_classes(layouts, shard) == brute


def test_a_divisible_mesh_is_one_class():
    layouts = [p for u in E.units_of(build("llama3-405b"), 128) for p in u]
    assert E.rank_classes(layouts, 128) == [(0, 128)]  # 16384, 1024, 53248 and 128256 rows: all / 128
    assert E.representative_ranks([(0, 128)], E.Mesh(128, 128)) == [0, 127, 16256, 16383]


def test_hybrid_shards_within_the_shard_group_and_all_reduces_across():
    report = simulate("reference", 12, "llama-tiny", mesh="3x4")
    assert report["summary"]["failed"] == 0, shard_layouts.human_summary(report)
    assert report["target"]["mesh"] == [3, 4] and report["target"]["strategy"] == "HYBRID_SHARD"
    assert report["cells"][-1]["check"] == "every_rank_by_class"
    grid = torch.arange(12).view(3, 4)  # init_device_mesh's layout: rows are shard groups
    shapes = {n: list(p.shape) for n, p in build("llama-tiny").named_parameters()}
    for r in report["ranks"]:
        rep, s = divmod(r["rank"], 4)
        for row in r["params"]:
            assert row["local_shape"][0] == _torch_chunk_rows(shapes[row["name"]][0], 4, s), row
        if r["collectives"] is not None:
            groups = {k: v["groups"] for k, v in r["collectives"].items()}
            shard_group = grid[rep].tolist()
            replicate_group = grid[:, s].tolist()
            assert groups == {"all_gather": [E.describe_ranks(shard_group)], "all_reduce": [E.describe_ranks(replicate_group)],
                              "reduce_scatter": [E.describe_ranks(shard_group)]}
    last = next(r for r in report["ranks"] if r["rank"] == 11)
    assert last["collectives"]["all_reduce"]["groups"] == ["3..11 step 4"]


def test_classes_hold_alike_when_every_rank_is_simulated():
    """The arithmetic's premise, checked by brute force: every rank of a class holds alike."""
    report = simulate("reference", 10, "llama-tiny", ranks=list(range(10)), step="none", mesh="2x5")
    assert report["summary"]["failed"] == 0, shard_layouts.human_summary(report)
    classes = E.rank_classes([p for u in E.units_of(build("llama-tiny"), 5) for p in u], 5)
    table = {r["rank"]: [(p["local_shape"], p["padded_rows"]) for p in r["params"]] for r in report["ranks"]}
    for rank, held in table.items():
        a = next(a for a, b in classes if a <= rank % 5 < b)
        assert held == table[a], rank


def test_world_cell_fails_when_a_class_is_not_alike_or_rows_go_missing():
    per_rank = [simulate_rank("reference", 12, "llama-tiny", r, step=False, mesh="3x4") for r in (0, 2, 3, 11)]
    mesh = E.Mesh(3, 4)
    layouts = [p for u in E.units_of(build("llama-tiny"), 4) for p in u]
    classes = E.rank_classes(layouts, 4)
    assert verdicts.every_rank_by_class(per_rank, classes, mesh, layouts)["outcome"] == "passed"
    merged = verdicts.every_rank_by_class(per_rank, [(0, 4)], mesh, layouts)  # claims ranks 0..3 alike
    assert merged["outcome"] == "failed" and "differ" in merged["detail"][0]
    shifted = verdicts.every_rank_by_class(per_rank, [(0, 2), (2, 4)], mesh, layouts)  # rank 2 counted twice
    assert shifted["outcome"] == "failed" and any("rows in all" in d for d in shifted["detail"])
    missing = verdicts.every_rank_by_class(per_rank[:1], classes, mesh, layouts)
    assert missing["outcome"] == "failed" and "without a simulated rank" in missing["detail"][-1]


def test_collectives_in_the_wrong_mesh_dimension_fail():
    result = simulate_rank("reference", 12, "llama-tiny", 5, mesh="3x4")
    units = E.units_of(build("llama-tiny"), 4)
    right = E.step_collectives(units, E.Mesh(3, 4), 5, 1)
    assert verdicts.collectives_per_step(result["collectives"], right, 5)["outcome"] == "passed"
    swapped = {k: dict(v, groups=[E.Mesh(3, 4).replicate_group(5) if k != "all_reduce" else E.Mesh(3, 4).shard_group(5)])
               for k, v in right.items()}
    cell = verdicts.collectives_per_step(result["collectives"], swapped, 5)
    assert cell["outcome"] == "failed" and "expected ['1..9 step 4']" in cell["detail"][0]
    no_all_reduce = E.step_collectives(units, E.Mesh(1, 4), 5, 1)  # forgets the replicas
    assert verdicts.collectives_per_step(result["collectives"], no_all_reduce, 5)["outcome"] == "failed"


def test_sharding_over_the_world_instead_of_the_shard_group_fails():
    result = simulate_rank("reference", 12, "llama-tiny", 5, step=False, mesh="3x4")
    over_world = [E.expected_row(p, 12, 5) for u in E.units_of(build("llama-tiny"), 12) for p in u]
    assert verdicts.sharded_dim0(result["params"], over_world, 5)["outcome"] == "failed"


def test_a_wrong_replicate_group_fails_the_run(monkeypatch, tmp_path):
    monkeypatch.setattr(E.Mesh, "replicate_group", lambda self, rank: E.progression(rank % self.shard, 1, self.replicate))
    out = tmp_path / "sim.json"
    assert cli.main(["simulate", "--world-size", "12", "--mesh", "3x4", "--model", "llama-tiny", "-o", str(out)]) == 1
    report = json.loads(out.read_text())
    failed = {c["check"] for c in report["cells"] if c["outcome"] == "failed"}
    assert failed == {"collectives_per_step"} and report["summary"]["passed"] > 0


def test_torch_fsdp2_on_a_2d_mesh():
    report = simulate("torch-fsdp2", 8, "llama-tiny", mesh="2x4", step="first")
    assert report["summary"]["failed"] == 0, shard_layouts.human_summary(report)
    ag = report["ranks"][0]["collectives"]
    assert ag["all_gather"]["count"] == 2 * ag["reduce_scatter"]["count"] == 2 * ag["all_reduce"]["count"]


def test_llama3_405b_sharding_at_16384_ranks_on_128x128():
    """The issue-14 target at init only (a few seconds; the CLI's default also runs two steps)."""
    report = simulate("reference", 16384, "llama3-405b", step="none", mesh="128x128")
    assert report["summary"] == {"passed": 9, "failed": 0}, shard_layouts.human_summary(report)
    assert report["target"]["ranks"] == [0, 127, 16256, 16383]
    assert report["classes"] == [{"shard_ranks": [0, 127], "ranks": 16384}]
    for r in report["ranks"]:  # every parameter divides by 128: no padding, 1/128 of the model each
        assert r["totals"]["storage_bytes"] == r["totals"]["bound_bytes"] == 405_853_388_800 * 4 // 128
        assert all(p["padded_rows"] == 0 for p in r["params"])
