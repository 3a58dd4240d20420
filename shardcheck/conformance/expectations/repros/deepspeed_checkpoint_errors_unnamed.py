"""F61: DeepSpeed's `engine.load_checkpoint` (ZeRO-3) of a damaged checkpoint, or of another model's,
raises errors that name neither the file nor the parameter, or none at all:
- a truncated `*_optim_states.pt`: torch's 'PytorchStreamReader failed reading zip archive', no path;
- the same file with bytes flipped in place (the same size): loads, no error (no checksum; torch.load
  does not check its zip CRC), and the run resumes from values nobody saved;
- a missing `zero_pp_rank_1_mp_rank_00_model_states.pt`: a bare AssertionError with no message;
- a checkpoint of a model with a wider layer: 'The size of tensor a (38) must match the size of
  tensor b (34)' (its flat partitions), naming no parameter."""

import functools
import os
import shutil

import torch
import torch.distributed as dist

from _launch import run, verdict


def _engine(width, world_size):
    import deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, width), torch.nn.ReLU(), torch.nn.Linear(width, 3),
                                torch.nn.ReLU(), torch.nn.Linear(3, 1))
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2), config={
        "train_batch_size": world_size, "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True})
    return engine


def _damage(path, rank, damage):
    folder = os.path.join(path, "tag")
    if rank == 0:
        optim = os.path.join(folder, "zero_pp_rank_1_mp_rank_00_optim_states.pt")
        if damage == "truncated":
            os.truncate(optim, os.path.getsize(optim) // 2)
        elif damage == "flipped":
            data = bytearray(open(optim, "rb").read())
            for i in range(len(data) // 2 - 32, len(data) // 2 + 32):
                data[i] ^= 0xFF
            open(optim, "wb").write(bytes(data))
        elif damage == "missing":
            os.remove(os.path.join(folder, "zero_pp_rank_1_mp_rank_00_model_states.pt"))
    dist.barrier()


def body(damage, rank, world_size):
    """One launch per damage: a rank that raised leaves the others in a collective."""
    os.environ.update(LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no JIT build of the shm op
    path = f"/tmp/shardcheck-f61-{os.getppid()}-{damage}"  # removed by the launching process, after both ranks
    engine = _engine(5, world_size)
    engine.backward(engine(torch.randn(4, 7)).sum())
    engine.step()
    engine.save_checkpoint(path, tag="tag")
    dist.barrier()
    _damage(path, rank, damage)
    try:
        loaded, _ = _engine(6 if damage == "other_shape" else 5, world_size).load_checkpoint(path, tag="tag")
        return f"{damage}: loaded ({loaded is not None})"
    except Exception as exc:
        names = any(n in str(exc) for n in ("zero_pp_rank", "0.weight", "2.weight"))
        return f"{damage}: {type(exc).__name__} naming the file or parameter: {names}"


if __name__ == "__main__":
    results = {}
    for damage in ("truncated", "flipped", "missing", "other_shape"):
        for rank, result in run(functools.partial(body, damage), world_size=2, timeout_s=60).items():
            results[f"{rank} {damage}"] = result
        # Not in a rank: one that raised early (the truncated file) would remove what the other still loads.
        shutil.rmtree(f"/tmp/shardcheck-f61-{os.getpid()}-{damage}", ignore_errors=True)
    text = " | ".join(results.values())
    verdict("truncated: RuntimeError naming the file or parameter: False" in text and "flipped: loaded (True)" in text
            and "missing: AssertionError naming the file or parameter: False" in text
            and "other_shape: RuntimeError naming the file or parameter: False" in text,
            "DeepSpeed's load_checkpoint names no file or parameter for damaged input, and loads flipped bytes", results)
