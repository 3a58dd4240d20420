"""Plain models used by the conformance checks.

Ported from torch 2.13's private test utilities (``common_fsdp.py``,
``distributed/_tensor/common_dtensor.py``) and from the seed tests, keeping
the same architecture, shapes and deterministic initialisation: a model built
here with ``deterministic=True`` (or after the same ``torch.manual_seed``) has
bit-identical parameters to torch's version built with
``FSDPInitMode.NO_FSDP``.

The models contain NO sharding logic. How a seed wraps a model into sharded
units is exposed as data (``WrapSpec`` in each class's ``WRAP_SPECS``) and is
applied by adapters (FSDP1 ``FullyShardedDataParallel``, FSDP2
``fully_shard``, or a third-party implementation). ``resolve_units`` turns a
spec into the ordered list of submodule paths to wrap.

Nothing here imports torch's private test utilities or ``torch.distributed.fsdp``.
"""


from shardcheck.conformance.checks.support.models.wrapping import ConformanceModel, RankedModel, ShardUnit, TPStyle, WrapSpec, resolve_units, unit_paths, wrap_spec_of
from shardcheck.conformance.checks.support.models.fsdp_models import Net, NestedWrappedModule, NonUniformReqGradNWM, TransformerWithSharedParams, TwoLinear
from shardcheck.conformance.checks.support.models.dtensor_models import MLP, Attention, ExpertLayer, Experts, FeedForward, MLPStack, ModelArgs, Transformer, TransformerBlock

__all__ = [
    "ShardUnit",
    "WrapSpec",
    "TPStyle",
    "resolve_units",
    "unit_paths",
    "wrap_spec_of",
    "ConformanceModel",
    "RankedModel",
    "TransformerWithSharedParams",
    "NestedWrappedModule",
    "NonUniformReqGradNWM",
    "MLP",
    "MLPStack",
    "ModelArgs",
    "Attention",
    "FeedForward",
    "Experts",
    "ExpertLayer",
    "TransformerBlock",
    "Transformer",
    "Net",
    "TwoLinear",
]


