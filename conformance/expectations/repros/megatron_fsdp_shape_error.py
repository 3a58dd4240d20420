"""F26: Megatron-FSDP (with the adapter's CPU shim) fails on some models with a shape error, as drawn
and shrunk by `shardcheck explore` at world size 2 ("shape '[-1, 6]' is invalid for input of size 2"
on every rank). Not isolated yet (Megatron-FSDP or the shim's padded all-gather for uneven flat
slices): this runs the explore configuration through the adapter."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository, for `conformance`

CONFIG = {"batch": 3, "bias": [False, True, False], "buffers": [0, 1], "data_seed": 0, "format": 1,
          "frozen": [], "grad_scale": 10.0, "growth_interval": 2, "loss_scale": None, "lr": 0.01,
          "max_norm": None, "mesh": None, "momentum": 0.0, "norm_type": 2.0, "optimizer": "adam",
          "param_dtype": "fp32", "poison": None, "reduce_dtype": "fp32", "steps": 4, "strategy": "FULL_SHARD",
          "tied": False, "units": [], "weight_decay": 0.0, "widths": [6, 3, 8, 1], "world_size": 2}


if __name__ == "__main__":
    from conformance.adapters import load
    from conformance.explore.config import from_json
    from conformance.explore.run import run_example

    outcome = run_example(load("megatron-fsdp"), from_json(CONFIG))
    print(json.dumps({"status": outcome.status, "headline": outcome.headline}))
    if outcome.status == "failed" and "is invalid for input of size" in outcome.headline:
        print("REPRODUCED: Megatron-FSDP fails with a shape error on a drawn model")
    else:
        print("NOT REPRODUCED: Megatron-FSDP fails with a shape error on a drawn model")
