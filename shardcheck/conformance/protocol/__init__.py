"""The contract between shardcheck and an implementation: adapter protocol, training-step recipe,
capability vocabulary, outcomes. Adapter authors import from here (see docs/adapters.md)."""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what a type checker reads (at runtime each name comes from its module on first use)
    from shardcheck.conformance.protocol.adapter import (Adapter, CheckpointingTrainer, ClosingTrainer,
                                                         EvaluatingTrainer, FineTuningTrainer, ParameterHolders,
                                                         StepResult, TokenCountingTrainer, TorchAPI, Trainer,
                                                         evaluation_loss, materialize,
                                                         on_meta)
    from shardcheck.conformance.protocol.capabilities import API, BEHAVIOUR, CAPABILITIES, STRATEGIES
    from shardcheck.conformance.protocol.outcomes import OUTCOMES, Outcome, Unsupported
    from shardcheck.conformance.protocol.spec import Clip, LossScale, MixedPrecision, Optimizer, Recipe, ShardSpec
    from shardcheck.conformance.protocol.torch_style import TorchStyleAdapter, TorchStyleTrainer
    from shardcheck.strategy import Strategy


__all__ = ["API", "Adapter", "BEHAVIOUR", "CAPABILITIES", "CheckpointingTrainer", "Clip", "ClosingTrainer",
           "EvaluatingTrainer", "FineTuningTrainer", "LossScale", "MixedPrecision",
           "OUTCOMES", "Optimizer", "Outcome", "ParameterHolders", "Recipe", "STRATEGIES", "ShardSpec", "StepResult", "Strategy", "TorchAPI",
           "TokenCountingTrainer", "TorchStyleAdapter", "TorchStyleTrainer", "Trainer", "Unsupported", "evaluation_loss", "materialize",
           "on_meta"]

# Each name from its module on first use (PEP 562): the pytest plugins import the light modules of
# this package (outcomes, capabilities) in every session; torch comes with the adapter protocol.
_HOME = {**dict.fromkeys(("Adapter", "CheckpointingTrainer", "ClosingTrainer", "EvaluatingTrainer", "FineTuningTrainer",
                          "ParameterHolders", "StepResult", "TokenCountingTrainer", "TorchAPI", "Trainer", "evaluation_loss", "materialize", "on_meta"), "adapter"),
         **dict.fromkeys(("API", "BEHAVIOUR", "CAPABILITIES", "STRATEGIES", "Strategy"), "capabilities"),
         **dict.fromkeys(("OUTCOMES", "Outcome", "Unsupported"), "outcomes"),
         **dict.fromkeys(("Clip", "LossScale", "MixedPrecision", "Optimizer", "Recipe", "ShardSpec"), "spec"),
         **dict.fromkeys(("TorchStyleAdapter", "TorchStyleTrainer"), "torch_style")}


def __getattr__(name: str) -> Any:
    if name in _HOME:
        return getattr(importlib.import_module(f"shardcheck.conformance.protocol.{_HOME[name]}"), name)
    raise AttributeError(f"module 'shardcheck.conformance.protocol' has no attribute {name!r}")
