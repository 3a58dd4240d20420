"""F55: FSDP2 leaves the padding of uneven shards to an all-gather extension (pytorch PR #137005:
"the user is responsible to return a padded sharded tensor"). A pre-all-gather hook that returns the
rank's own rows, as torchao's float8 weights did (pytorch/ao#3982), is refused only on the ranks whose
shard is short ("must return all-gather inputs with the padded sharded size"); the rank with the full
chunk goes on into the all-gather and waits there until the process group times out."""

import time
import types

import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

from _launch import run, verdict

TIMEOUT_S = 5
# torch 2.9 calls the hooks of a plain tensor subclass's class; from 2.10 the hooks bound onto the
# plain shard object (F7), and a plain subclass is no longer asked.
SHARD_OBJECT_HOOKS = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 10)


class LocalRows(torch.Tensor):
    """A tensor subclass with all-gather hooks that return this rank's rows as they are."""

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        return (self.as_subclass(torch.Tensor),), None  # unpadded: 2 rows on rank 0, 1 on rank 1 of 3

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        if out is not None:
            return None
        (full,) = outputs
        return full.to(param_dtype), (full,)


def body(rank, world_size):
    torch.manual_seed(0)
    model = nn.Linear(8, 3, bias=False)  # 3 rows over 2 ranks
    if not SHARD_OBJECT_HOOKS:
        model.weight = nn.Parameter(model.weight.detach().as_subclass(LocalRows))
    fully_shard(model)
    if SHARD_OBJECT_HOOKS:
        local = model.weight._local_tensor  # to_local() returns a fresh view each call (gh-166156)
        local.fsdp_pre_all_gather = types.MethodType(LocalRows.fsdp_pre_all_gather, local)
        local.fsdp_post_all_gather = types.MethodType(LocalRows.fsdp_post_all_gather, local)
    try:
        model(torch.randn(2, 8)).sum().backward()
    except AssertionError:
        time.sleep(TIMEOUT_S + 1)  # stay in the group (as a test's rank does) while the others wait
        raise
    return "forward and backward ran"


if __name__ == "__main__":
    results = run(body, world_size=2, timeout_s=TIMEOUT_S)
    verdict("padded sharded size" in results[1] and "padded sharded size" not in results[0]
            and "Timed out" in results[0],
            "FSDP2 refused the unpadded local rows on the short rank only; rank 0 waited in the all-gather", results)
