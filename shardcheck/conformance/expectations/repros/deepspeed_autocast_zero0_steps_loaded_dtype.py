"""F77: DeepSpeed's `torch_autocast` without ZeRO (stage 0) keeps no float32 master weights for a model
that arrives in bfloat16 (loaded with `from_pretrained(dtype=torch.bfloat16)`, say): torch_autocast
leaves the parameters in the dtype they come in (it only runs the forward under torch.autocast), and at
stage 0 the engine wraps no optimizer, so the client optimizer steps the bf16 parameters themselves, as
torch's optimizers step the parameters they are given. ZeRO-1 (stage 1), same model and config, steps
float32 master partitions built from them (safe_get_full_fp32_param holds values bf16 cannot)."""

import functools
import os

import torch
import torch.nn as nn

from _launch import run, verdict


def body(stage, rank, world_size):
    os.environ.update(DS_ACCELERATOR="cpu", LOCAL_RANK=str(rank))
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1)).to(torch.bfloat16)  # as loaded in bf16
    config = {"train_batch_size": world_size, "train_micro_batch_size_per_gpu": 1,
              "zero_allow_untested_optimizer": True, "zero_optimization": {"stage": stage},
              "torch_autocast": {"enabled": True, "dtype": "bfloat16"}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                      config=config)
    for step in range(2):
        engine.backward(engine(torch.randn(4, 8) + rank).float().pow(2).mean())
        engine.step()
    masters = [safe_get_full_fp32_param(p) for p in engine.module.parameters()]
    masters = [p.detach() if m is None else m for m, p in zip(masters, engine.module.parameters())]
    wide = sum(not torch.equal(m.float(), m.to(torch.bfloat16).float()) for m in masters)
    dtypes = sorted({str(m.dtype) for m in masters})
    return f"stage {stage}: master weights {dtypes}, {wide} of {len(masters)} hold values bf16 cannot"


if __name__ == "__main__":
    results = {}
    for stage in (0, 1):
        for rank, result in run(functools.partial(body, stage), world_size=2, timeout_s=120).items():
            results[f"{rank} stage {stage}"] = result
    text = " | ".join(results.values())
    verdict(text.count("stage 0: master weights ['torch.bfloat16'], 0 of 4") == 2
            and text.count("stage 1: master weights ['torch.float32'], 4 of 4") == 2,
            "torch_autocast at stage 0 steps the bf16 parameters as loaded (no float32 master weights); "
            "ZeRO-1 steps float32 master partitions", results)
