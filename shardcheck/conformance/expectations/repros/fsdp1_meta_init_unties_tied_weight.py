"""F47: FSDP1 built from a model on the meta device unties a weight two modules share (tied input and
output projections): its materialization calls `module.to_empty(recurse=False)` module by module
(_init_utils.py, _materialize_meta_module), and to_empty gives each module a new Parameter of its own.
The wrapped model then has one more parameter than the plain one, initialised and trained apart.
Built on the CPU, the same model stays tied (the training_loop family's tied cells pass)."""

import torch
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from _launch import run, verdict


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.decode = nn.Linear(4, 4), nn.Linear(4, 4)
        self.decode.weight = self.embed.weight


def body(rank, world_size):
    plain = len(list(Tied().parameters()))
    with torch.device("meta"):
        model = Tied()
    model = FSDP(model, device_id=torch.device("cpu"), use_orig_params=True)
    return f"parameters: plain model {plain}, FSDP1 from meta {len(list(model.parameters()))}"


if __name__ == "__main__":
    results = run(body, world_size=2, timeout_s=60)
    verdict(all("plain model 3, FSDP1 from meta 4" in str(r) for r in results.values()),
            "FSDP1's meta-device materialization turned one shared weight into two parameters", results)
