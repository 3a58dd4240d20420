"""The contract between shardcheck and an implementation: adapter protocol, training-step recipe,
capability vocabulary, outcomes. Adapter authors import from here (see docs/adapters.md)."""

from conformance.protocol.adapter import Adapter, StepResult, TorchAPI, Trainer
from conformance.protocol.capabilities import API, BEHAVIOUR, CAPABILITIES, STRATEGIES
from conformance.protocol.outcomes import OUTCOMES, Unsupported
from conformance.protocol.spec import Clip, LossScale, MixedPrecision, Optimizer, Recipe, ShardSpec
from conformance.protocol.torch_style import TorchStyleAdapter, TorchStyleTrainer


__all__ = ["API", "Adapter", "BEHAVIOUR", "CAPABILITIES", "Clip", "LossScale", "MixedPrecision",
           "OUTCOMES", "Optimizer", "Recipe", "STRATEGIES", "ShardSpec", "StepResult", "TorchAPI",
           "TorchStyleAdapter", "TorchStyleTrainer", "Trainer", "Unsupported"]
