"""F9: torch.nn.utils.clip_grad_norm_(norm_type=inf) fails on a rank whose shard of a parameter is
empty (fully_shard of a parameter with fewer rows than ranks): '_foreach_norm cannot compute the
infinity norm on an empty tensor' (torch 2.9: 'linalg.vector_norm cannot compute the inf norm on an
empty tensor'). Finite norm types are fine."""

import re

import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

from _launch import run, verdict


def body(rank, world_size):
    torch.manual_seed(0)
    model = fully_shard(nn.Linear(4, 2))  # weight 2 x 4: ranks 2 and 3 hold no rows
    model(torch.randn(3, 4)).sum().backward()
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, norm_type=float("inf"))
    return f"inf-norm {total.full_tensor().item():.4f}"


if __name__ == "__main__":
    results = run(body, world_size=4)
    verdict(all(re.search("inf(inity)? norm on an empty tensor", results[r]) for r in (2, 3)),  # 2.9: "inf"
            "clip_grad_norm_(inf) fails on ranks with an empty shard (ranks 2 and 3 of 4)", results)
