"""Under torch.compile a unit's forward hooks run eagerly, as FSDP2's do (reference_impl/compiled.py):
each compiled layer is one graph of its own compute, with no collective in it and no frame for the
hooks' graph breaks, and the sharded model still computes what the unsharded one does."""
import copy

import pytest
import torch
import torch.nn as nn

import shardcheck.reference_impl as R
from shardcheck.harness import distributed


@distributed(world_size=2)
def test_a_compiled_layers_hooks_run_eagerly(ctx):
    if ctx.is_threaded:
        pytest.skip("torch.compile's caches and guards are process-global: the rank threads would share them")
    torch._dynamo.reset()
    graphs: list[list[str]] = []

    def backend(gm, example_inputs):
        graphs.append([str(node.target) for node in gm.graph.nodes if node.op == "call_function"])
        return gm.forward

    with ctx.seeded(0):
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    ref = copy.deepcopy(model)
    for unit in (model[0], model[2], model):
        R.shard(unit, process_group=ctx.group)
    model[0].compile(backend=backend)
    model[2].compile(backend=backend)
    with ctx.seeded(1 + ctx.rank):
        x = torch.randn(3, 4)
    torch.testing.assert_close(model(x), ref(x))
    assert len(graphs) == 2, f"{len(graphs)} graphs for two compiled layers: {graphs}"
    assert all(any("linear" in target for target in g) for g in graphs), graphs
    collectives = [t for g in graphs for t in g if any(c in t for c in ("c10d", "all_gather", "reduce_scatter"))]
    assert not collectives, f"a compiled graph holds collectives: {collectives}"
