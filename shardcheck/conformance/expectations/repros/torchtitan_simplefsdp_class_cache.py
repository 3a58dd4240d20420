"""F17: torchtitan SimpleFSDP caches the wrapper class per (module class, parameter names), and the
class's parameter properties close over the parametrization of the FIRST module wrapped: a second
`data_parallel` call in the same process (another model, another mesh, mode or mixed-precision
policy) computes with the first call's settings. Here the first asked for bfloat16 compute and the
second for none: the second casts its weight to bfloat16 anyway, and its float32 forward fails."""

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from _launch import run, verdict


def body(rank, world_size):
    from torchtitan.experiments.graph_trainer.simple_fsdp import MixedPrecisionPolicy, data_parallel

    mesh = init_device_mesh("cpu", (world_size,))
    x = torch.randn(2, 4)
    first = data_parallel(nn.Linear(4, 4), mesh, "fully_shard", MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    second = data_parallel(nn.Linear(4, 4), mesh, "fully_shard")  # no mixed precision asked
    return f"first wrapped {type(first).__name__}, second output dtype {second(x).dtype}"  # float32 expected


if __name__ == "__main__":
    results = run(body, world_size=2, timeout_s=60)
    verdict(all("Float and BFloat16" in r for r in results.values()),
            "a second data_parallel() computes with the first call's param_dtype (bfloat16)", results)
