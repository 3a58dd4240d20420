"""F52: FSDP2 on torch 2.9 (fixed in 2.10.0) all-gathers a unit nested in a checkpointed unit once
more per step: the forward that checkpointing recomputes in backward reshards the inner unit when it
ends, so its backward gathers it again (F46 is FSDP1's form). From torch 2.10.0 on, fully_shard's
post-forward recognises a forward that runs inside backward and keeps the unit gathered. The verdict
holds for the running torch: more all-gathers with checkpointing before 2.10, as many as without
from 2.10 on."""

import re

import torch
from torch.distributed.fsdp import fully_shard

from _collectives import counting
from _launch import run, verdict
from _nested import Net


def gathers(checkpointed):
    torch.manual_seed(0)
    model = Net(checkpointed)
    for unit in (model.layer.mix, model.layer.mlp, model.layer, model):  # units inside a unit, then the root
        fully_shard(unit)
    with counting() as seen:
        model(torch.randn(4, 8)).sum().backward()
    return sum(calls for kind, (calls, _) in seen.seen.items() if "gather" in kind)


def body(rank, world_size):
    return f"all-gathers in one step: {gathers(False)} without checkpointing, {gathers(True)} with it"


if __name__ == "__main__":
    results = run(body, world_size=2, timeout_s=60)
    counts = [[int(n) for n in re.findall(r": (\d+) without checkpointing, (\d+) with it", r)[0]] if "with it" in r else []
              for r in results.values()]
    before_fix = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < (2, 10)
    verdict(all(len(c) == 2 and (c[1] > c[0]) == before_fix for c in counts),
            f"torch {torch.__version__}: FSDP2 gathers a nested unit again under checkpointing "
            f"{'(present before 2.10)' if before_fix else 'no more (fixed in 2.10.0)'}", results)
