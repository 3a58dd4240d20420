"""What the DeepSpeed adapter undoes after each engine (adapters/deepspeed_runtime.release), where
DeepSpeed is installed (CI's DeepSpeed step): an engine built with `torch_autocast` sets module
globals that nothing in DeepSpeed clears (FINDINGS F76), and every later engine of the process would
then reduce in its parameters' dtype, not in its own communication_data_type. A cell of
`deepspeed[autocast]` followed, in the same rank process, by a cell of `deepspeed` met exactly that."""

from __future__ import annotations

import pytest
import torch

from shardcheck.harness import run as run_body

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed: CI's DeepSpeed step runs this")


def _autocast_engine_then_release(ctx):
    from shardcheck.conformance.adapters import deepspeed_runtime

    ds = deepspeed_runtime.load()
    from deepspeed.runtime import torch_autocast

    model = torch.nn.Linear(1, 3)
    config = {"train_batch_size": ctx.world_size, "train_micro_batch_size_per_gpu": 1,
              "zero_allow_untested_optimizer": True, "zero_optimization": {"stage": 1},
              "torch_autocast": {"enabled": True, "dtype": "bfloat16"}}
    engine, *_ = ds.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), config=config)
    assert torch_autocast.is_autocast_initialized(), "the engine set no torch_autocast state: nothing to undo"
    deepspeed_runtime.release(engine)
    assert not torch_autocast.is_autocast_initialized(), "torch_autocast state outlived its engine (F76)"
    assert torch_autocast.TORCH_AUTOCAST_DTYPE is None


def test_release_clears_the_torch_autocast_state_an_engine_left():
    verdict = run_body(_autocast_engine_then_release, 1, backend="gloo", timeout=240)
    assert verdict.outcome == "passed", verdict.message
