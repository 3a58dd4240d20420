"""F38: Accelerate's FSDP2 path drops a callable `auto_wrap_policy`, silently. The plugin documents
`auto_wrap_policy` as "a callable or string" and FSDP1 passes the callable to torch; with
`fsdp_version=2`, `fsdp2_prepare_auto_wrap_policy` recognises only `transformer_auto_wrap_policy`
(taking its classes from `transformer_cls_names_to_wrap` or `_no_split_modules`, never from the
partial) and `size_based_auto_wrap_policy`, and returns None for anything else: `prepare` shards the
root alone, one unit for the whole model, with no error or warning. The same callable under FSDP1,
and the string form `"transformer_based_wrap"` with class names under FSDP2, make the two blocks units.

On a CPU-only machine Accelerate does not build FSDP at all (F27): the lines marked SHIM give the
state what accelerate/state.py gives it on a GPU machine. The policy is read in prepare, past the shim."""

import functools
import os
import warnings

import torch
import torch.nn as nn

from _launch import run, verdict


def units(world_size, rank, **plugin_kwargs):
    from accelerate import Accelerator, PartialState
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    AcceleratorState._reset_state(reset_partial_state=True)  # a fresh Accelerator per case
    plugin = FullyShardedDataParallelPlugin(**plugin_kwargs)
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    for state in (PartialState(), accelerator.state):  # SHIM (F27)
        state.distributed_type = DistributedType.FSDP  # SHIM
        state.device = torch.device("cpu")  # SHIM
    accelerator.state.fsdp_plugin = plugin  # SHIM
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.Sequential(nn.Linear(4, 4), nn.ReLU()),
                          nn.Linear(4, 1))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))  # FSDP2: together
    unit = (FSDPModule, FullyShardedDataParallel)
    return sum(isinstance(m, unit) for m in model.modules()) - 1, len(seen)


def body(rank, world_size):
    from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy, transformer_auto_wrap_policy

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    blocks = functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, nn.Sequential)
                               and isinstance(m[0], nn.Linear))
    by_class = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={nn.Sequential})
    cases = {"fsdp1 callable": dict(fsdp_version=1, auto_wrap_policy=blocks),
             "fsdp2 callable": dict(fsdp_version=2, auto_wrap_policy=blocks),
             "fsdp2 transformer partial": dict(fsdp_version=2, auto_wrap_policy=by_class),
             "fsdp2 transformer_based_wrap": dict(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                                  transformer_cls_names_to_wrap=["Sequential"])}
    out = []
    for name, kwargs in cases.items():
        n, warned = units(world_size, rank, **kwargs)
        out.append(f"{name}: {n} units below the root, {warned} warnings")
    return "; ".join(out)


if __name__ == "__main__":
    results = run(body, world_size=2, timeout_s=60)
    verdict(all("fsdp1 callable: 2 units" in r and "fsdp2 callable: 0 units below the root, 0 warnings" in r
                and "fsdp2 transformer partial: 0 units below the root, 0 warnings" in r
                and "fsdp2 transformer_based_wrap: 2 units" in r for r in results.values()),
            "FSDP2 prepare ignores a callable auto_wrap_policy (the model is one unit, no warning); FSDP1 honours it",
            results)
