"""F73: Accelerate's FSDP2 path cannot prepare a transformers model without input embeddings (a vision
model). `fsdp2_prepare_model` carves the input embedding into its own unit with
`getattr(model, "get_input_embeddings", lambda: None)()`, expecting None where there is none; from
transformers 5 `PreTrainedModel.get_input_embeddings` raises NotImplementedError ("not auto-handled for
ResNetModel; please override in the subclass") for a model it cannot find one in, so
`accelerator.prepare` raises for ResNet under `fsdp_version=2`. The same model under the FSDP1 plugin
prepares and trains.

On a CPU-only machine Accelerate does not build FSDP at all (F27): the lines marked SHIM give the
state what accelerate/state.py gives it on a GPU machine. The call that raises is past the shim."""

import os

import torch

from _launch import run, verdict


def prepared(fsdp_version):
    import transformers
    from accelerate import Accelerator, PartialState
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    AcceleratorState._reset_state(reset_partial_state=True)  # a fresh Accelerator per case
    plugin = FullyShardedDataParallelPlugin(fsdp_version=fsdp_version, auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=["ResNetStage"])
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    for state in (PartialState(), accelerator.state):  # SHIM (F27)
        state.distributed_type = DistributedType.FSDP  # SHIM
        state.device = torch.device("cpu")  # SHIM
    accelerator.state.fsdp_plugin = plugin  # SHIM
    config = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic",
                                       num_labels=5)
    model = transformers.ResNetForImageClassification(config)
    try:
        accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    except NotImplementedError as e:
        return f"raised NotImplementedError: {e}"
    return "prepared"


def body(rank, world_size):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    return f"fsdp1: {prepared(1)}; fsdp2: {prepared(2)}"


if __name__ == "__main__":
    results = run(body, world_size=2, timeout_s=120)
    verdict(all("fsdp1: prepared; fsdp2: raised NotImplementedError" in str(r) and "get_input_embeddings" in str(r)
                for r in results.values()),
            "Accelerate's FSDP2 prepare raised on a transformers vision model (get_input_embeddings), FSDP1's did not",
            results)
