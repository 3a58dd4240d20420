"""F51: a layer compiled with torch.compile (`layer.compile()`) and wrapped by FSDP1 with flat
parameters (use_orig_params=False, FSDP1's default) runs eagerly, silently: dynamo never hands the
compiler a graph: "Dynamo only supports FSDP with use_orig_params=True", raised inside dynamo, suppressed,
and the frame falls back to eager (visible only with TORCH_LOGS=graph_breaks). The
numbers are eager training's; the speed a user compiled for is not there, and nothing says so. With
use_orig_params=True the same layer is compiled."""

import torch
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from _launch import run, verdict


class Layer(nn.Module):  # a user's module (dynamo does not trace torch.nn's own forwards as entry points)
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return torch.tanh(self.lin(x))


def graphs(use_orig_params):
    handed = []

    def backend(graph, example_inputs):
        handed.append(graph)
        return graph.forward

    torch._dynamo.reset()
    layer = Layer()
    layer.compile(backend=backend)
    cpu = torch.device("cpu")
    unit = FSDP(layer, device_id=cpu, use_orig_params=use_orig_params)  # the compiled layer is a unit
    model = FSDP(nn.Sequential(nn.Linear(4, 4), unit), device_id=cpu, use_orig_params=use_orig_params)
    for _ in range(2):
        model(torch.randn(2, 4)).sum().backward()
    return len(handed)


def body(rank, world_size):
    return f"graphs compiled: use_orig_params=False {graphs(False)}, use_orig_params=True {graphs(True)}"


if __name__ == "__main__":
    results = run(body, world_size=2, timeout_s=120)
    verdict(all("use_orig_params=False 0," in r and "use_orig_params=True 0" not in r for r in results.values()),
            "FSDP1 with flat parameters runs a compiled layer eagerly, silently", results)
