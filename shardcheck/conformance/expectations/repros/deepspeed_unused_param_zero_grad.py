"""F42: DeepSpeed ZeRO (stages 1-3) gives a parameter the loss never uses a ZERO gradient and steps it:
its gradients live in flat fp32 partitions, so `safe_get_full_grad` returns zeros where unsharded
training (and DDP with find_unused_parameters=True) has None, and the optimizer updates the whole
partition: AdamW's weight decay moves a parameter that unsharded training leaves untouched.
Found by the training_loop family."""

import os

import torch

from _launch import run, verdict


class WithSpare(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.spare = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.used(x)  # self.spare is never called


def body(rank, world_size):
    os.environ.update(LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    import deepspeed
    import deepspeed.ops
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no JIT build of the shm op
    torch.manual_seed(0)
    model = WithSpare()
    before = model.spare.weight.detach().clone()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config={
        "train_batch_size": world_size, "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True})
    engine.backward(engine(torch.ones(3, 4)).sum())
    grad = safe_get_full_grad(engine.module.spare.weight)
    engine.step()
    after = safe_get_full_fp32_param(engine.module.spare.weight)
    return f"unused weight: grad {None if grad is None else grad.abs().sum().item()}, moved: {not torch.equal(after, before)}"


if __name__ == "__main__":
    results = run(body, world_size=2, timeout_s=120)
    verdict(all("grad 0.0" in r and "moved: True" in r for r in results.values()),
            "ZeRO gives an unused parameter a zero gradient and AdamW's weight decay moves it", results)
