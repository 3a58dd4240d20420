"""A user's own Accelerate config file (the YAML `accelerate config` writes) as the `accelerate[config]`
variant's plugin: `SHARDCHECK_ACCELERATE_CONFIG=my_config.yaml shardcheck run --impl 'accelerate[config]'` (the
variant exists only while the variable is set).

The file's `fsdp_config` keys are the `FullyShardedDataParallelPlugin` fields with an `fsdp_` prefix
(`fsdp_version`, `fsdp_sharding_strategy`, `fsdp_reshard_after_forward`, `fsdp_use_orig_params`, ...;
`fsdp_offload_params` is `cpu_offload`, `fsdp_transformer_layer_cls_to_wrap` is
`transformer_cls_names_to_wrap`), and `mixed_precision` is the Accelerator's. A config fixes one
strategy and one precision: a cell asking for another is unsupported, with the reason; every other
cell runs the config as written (a bf16 config reduces gradients in bf16 unless it says otherwise, and
is judged on that). A config that names no `fsdp_auto_wrap_policy` gets the cell's units as the other
variants do (accelerate.wrap_for); one that names a policy keeps it.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import yaml

from shardcheck.strategy import Strategy
from shardcheck.conformance.protocol import Unsupported

ENV = "SHARDCHECK_ACCELERATE_CONFIG"
RENAMED = {"offload_params": "cpu_offload", "transformer_layer_cls_to_wrap": "transformer_cls_names_to_wrap",
           "version": "fsdp_version"}
DTYPES = {"no": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def load(plugin_class) -> tuple[dict, str]:
    """(the plugin's keyword arguments, the Accelerator's mixed_precision) from the file `$ENV` names."""
    path = os.environ.get(ENV)
    if not path:
        raise ValueError(f"accelerate[config] judges the Accelerate config file named by ${ENV}: not set")
    with open(path) as f:
        config = yaml.safe_load(f) or {}
    fields = {f.name for f in dataclasses.fields(plugin_class)}
    kwargs = {RENAMED.get(k.removeprefix("fsdp_"), k.removeprefix("fsdp_")): v
              for k, v in (config.get("fsdp_config") or {}).items()}
    unknown = sorted(set(kwargs) - fields)
    if unknown:
        raise ValueError(f"{path}: fsdp_config keys {', '.join(unknown)} are not FullyShardedDataParallelPlugin fields")
    return kwargs, str(config.get("mixed_precision", "no"))


def check_cell(kwargs: dict, mixed_precision: str, spec) -> None:
    """Unsupported unless the cell asks for the config's strategy and precision."""
    strategy: str
    if int(kwargs.get("fsdp_version", 1)) == 2:
        strategy = Strategy.FULL_SHARD if kwargs.get("reshard_after_forward", True) in (True, "true", "True") else Strategy.SHARD_GRAD_OP
    else:
        strategy = str(kwargs.get("sharding_strategy", "FULL_SHARD")).upper()  # accelerate's own config word
    if spec.strategy != strategy:
        raise Unsupported(f"the config shards as {strategy}, the cell asks for {spec.strategy}")
    wanted = spec.mixed_precision.param_dtype if spec.mixed_precision else None
    if DTYPES.get(mixed_precision) != wanted:
        raise Unsupported(f"the config's mixed_precision is {mixed_precision!r}, the cell computes in {wanted or 'float32'}")
