"""F1: FSDP2 + TP (2-D, sequence parallel) vs replicate(): on MLPStack(with_seq_parallel=True) the
loss out.sum() after LayerNorm(bias=False) is ~0 for any input, so gradients before the LayerNorm
are float noise (~1e-6): the two reduction orders give different noise, as large as the gradient,
and past atol=1e-5 within a few steps. A test issue (an invariant loss), not a torch bug."""

import copy

import torch
from torch.distributed._composable.replicate import replicate
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

from shardcheck.conformance.checks.support.models.dtensor_models import MLPStack  # torch's, ported

from _launch import run, verdict


def torch_plan(model):
    plan = {}
    for path, s in model.tp_plan().items():  # the port's plan as torch's styles
        extra = {} if s.output_shard_dim is None else {"output_layouts": Shard(s.output_shard_dim)}
        style = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}.get(s.kind)
        plan[path] = (SequenceParallel(sequence_dim=s.sequence_dim) if s.kind == "sequence"
                      else style(use_local_output=s.use_local_output, **extra))
    return plan


def body(rank, world_size):
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(42)
    model = MLPStack(16, with_seq_parallel=True)
    ref = replicate(copy.deepcopy(model), process_group=mesh["dp"].get_group())
    parallelize_module(model, mesh["tp"], torch_plan(model))  # as torch's MLPStack.parallelize does
    for unit in [m for m in model if not isinstance(m, torch.nn.LayerNorm)] + [model]:
        fully_shard(unit, mesh=mesh["dp"], reshard_after_forward=True)
    inp = torch.randn(2, 16)
    ref(inp).sum().backward()
    model(inp).sum().backward()
    ref_grads = dict(ref.named_parameters())
    diff = {n: (ref_grads[n].grad - p.grad.full_tensor()).abs().max().item() for n, p in model.named_parameters()}
    worst = max(diff, key=diff.get)
    size = ref_grads[worst].grad.abs().max().item()
    return f"{worst}: max |ref grad| {size:.2e}, max |diff| {diff[worst]:.2e}, ratio {diff[worst] / size:.2f}"


if __name__ == "__main__":
    results = run(body, world_size=4, timeout_s=60)
    ratios = [float(r.rsplit(" ", 1)[1]) for r in results.values() if "ratio" in r]
    verdict(len(ratios) == 4 and min(ratios) > 0.5,
            "the gradients are float noise: FSDP2+TP and replicate differ by more than half their size", results)
