"""F78: Accelerate 1.13.0's FSDP2 prepare keeps a bfloat16 model's weights in bfloat16 under
mixed_precision="bf16", although it says it upcast them. `fsdp2_prepare_model` ends with a loop meant
to give FSDP2 float32 master weights (the promise of Accelerate's concept guide "FSDP vs DeepSpeed",
low-precision loading upcast to float32 when mixed precision is on), but it rebinds the loop variable,
`param = param.to(torch.float32)`, so no parameter changes; it still warns "FSDP upcast of low
precision parameters to fp32 ... This effects N parameters". The optimizer then steps bfloat16 weights.
Accelerate 1.15.0 upcasts (`param.data = param.data.to(torch.float32)`, before `fully_shard`). The
verdict is per release: the bug before 1.15 (1.14 not measured), the fix from 1.15.

On a CPU-only machine Accelerate does not build FSDP at all (F27): the lines marked SHIM give the
state what accelerate/state.py gives it on a GPU machine. The upcast is past the shim."""

import os

import torch

from _launch import run, verdict


def body(rank, world_size):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    import accelerate
    import transformers
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=["LlamaDecoderLayer"])
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin, mixed_precision="bf16")
    for state in (PartialState(), accelerator.state):  # SHIM (F27)
        state.distributed_type = DistributedType.FSDP  # SHIM
        state.device = torch.device("cpu")  # SHIM
    accelerator.state.fsdp_plugin = plugin  # SHIM
    plugin.set_mixed_precision("bf16")  # SHIM: what Accelerator does with the plugin on a GPU machine
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)  # as from_pretrained(dtype=torch.bfloat16)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    ids = torch.randint(0, 128, (2, 8))
    accelerator.backward(model(input_ids=ids, labels=ids).loss)
    optimizer.step()
    dtypes = sorted({str(p.dtype) for p in model.parameters() if p.requires_grad})
    return f"accelerate {accelerate.__version__}: trainable weights after a step: {', '.join(dtypes)}"


if __name__ == "__main__":
    from importlib.metadata import version

    release = version("accelerate")
    before_fix = tuple(int(p) for p in release.split("+")[0].split(".")[:2]) < (1, 15)
    results = run(body, world_size=2, timeout_s=180)
    wanted = "torch.bfloat16" if before_fix else "torch.float32"
    verdict(all(f"weights after a step: {wanted}" in str(r) for r in results.values()),
            f"Accelerate {release}: its FSDP2 prepare "
            + ("left a bfloat16 model's trainable weights in bfloat16 under mixed_precision='bf16' (no float32 "
               "master weights; fixed by 1.15)" if before_fix else "upcast a bfloat16 model's trainable weights to "
               "float32 under mixed_precision='bf16' (fixed by 1.15)"), results)
