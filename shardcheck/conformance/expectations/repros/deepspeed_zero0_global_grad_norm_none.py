"""F74: DeepSpeed without ZeRO (`zero_optimization.stage` 0) in float32 clips the gradients
(`gradient_clipping`: the engine calls its own clip_grad_norm_, which computes the global 2-norm) and
then `engine.get_global_grad_norm()`, its documented reader of that norm, returns None: the norm the
clip computed is dropped (engine._take_model_step records only an optimizer's `_global_grad_norm`, and
the client torch optimizer has none). ZeRO-1 (stage 1), same model and config, returns the norm.
Stage 0 under DeepSpeed's documented `torch_autocast` (bfloat16: float32 parameters, the forward under
torch.autocast; neither its fp16 nor its bf16 section) takes the same float32 clip and drops it too."""

import functools
import os

import torch
import torch.nn as nn

from _launch import run, verdict


def body(stage, rank, world_size, autocast=False):
    os.environ.update(DS_ACCELERATOR="cpu", LOCAL_RANK=str(rank))
    import deepspeed

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    config = {"train_batch_size": world_size, "train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.01,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True}
    if autocast:
        config["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                      config=config)
    engine.backward(engine(torch.randn(4, 8) + rank).pow(2).mean())
    grads = [p.grad.clone() for p in engine.module.parameters()] if stage == 0 else []
    before = [p.detach().clone() for p in engine.module.parameters()]
    engine.step()
    norm = engine.get_global_grad_norm()
    clipped = None
    if stage == 0:  # the step did clip: SGD moved each parameter by lr * grad * (0.01 / norm)
        total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        moved = [b - p.detach() for b, p in zip(before, engine.module.parameters())]
        clipped = all(torch.allclose(m, 0.1 * g * 0.01 / (total + 1e-6), atol=1e-7) for m, g in zip(moved, grads))
    name = f"stage {stage}{' autocast' if autocast else ''}"
    return f"{name}: get_global_grad_norm() = {norm}" + ("" if clipped is None else f"; clipped: {clipped}")


if __name__ == "__main__":
    results = {}
    for stage, autocast in ((0, False), (1, False), (0, True)):
        ranks = run(functools.partial(body, stage, autocast=autocast), world_size=2, timeout_s=120)
        for rank, result in ranks.items():
            results[f"{rank} stage {stage}{' autocast' if autocast else ''}"] = result
    text = " | ".join(results.values())
    verdict(text.count("stage 0: get_global_grad_norm() = None; clipped: True") == 2
            and text.count("stage 0 autocast: get_global_grad_norm() = None; clipped: True") == 2
            and text.count("stage 1: get_global_grad_norm() = None") == 0 and text.count("stage 1: get_global_grad_norm() =") == 2,
            "stage 0 (float32, and under torch_autocast) clips but get_global_grad_norm() returns None; "
            "stage 1 returns the norm", results)
