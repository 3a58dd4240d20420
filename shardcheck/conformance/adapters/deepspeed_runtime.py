"""DeepSpeed's process-level needs in a long-lived test worker, apart from the adapter's mapping:
import it on the CPU accelerator without its JIT op build, and free what `engine.destroy()` keeps."""

from __future__ import annotations

import gc
import os


def load():
    """Import DeepSpeed on the CPU accelerator, without JIT-building its shared-memory comm op."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.ops
    # deepspeed/comm/torch.py JIT-builds it (a long compile) unless marked incompatible; training never uses it.
    if deepspeed.ops.__compatible_ops__.get("deepspeed_shm_comm", True):
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        gc.collect()
        gc.freeze()  # ZeRO-3 init runs gc.collect() (zero/utils.defragment) per engine: cheap once frozen
    return deepspeed


def release(engine) -> None:
    """engine.destroy(), then what it leaves holding every ZeRO-3 engine alive (FINDINGS F14),
    torch.nn.functional.linear, which a ZeRO-3 engine replaces for the whole process (F31), and the
    process-wide torch_autocast state an engine with `torch_autocast` enabled sets and never clears
    (F76: every later engine of the process would reduce in its parameters' dtype, not in its own
    communication_data_type)."""
    import torch.nn.functional
    from deepspeed.runtime import torch_autocast
    from deepspeed.runtime.zero import parameter_offload
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    module = engine.module
    engine.destroy()
    original = getattr(InsertPostInitMethodToModuleSubClasses, "linear_bk", None)  # saved before replacing
    if original is not None:
        torch.nn.functional.linear = original
    torch_autocast.TORCH_AUTOCAST_INITIALIZED = False  # F76: module globals ("TODO: Avoid using global variables")
    torch_autocast.TORCH_AUTOCAST_DTYPE = None
    parameter_offload.FWD_MODULE_STACK[:] = [m for m in parameter_offload.FWD_MODULE_STACK if m is not module]
    cached = PartitionedParameterCoordinator.__dict__["_PartitionedParameterCoordinator__params_to_release"]
    for cell in cached.__closure__ or ():
        if hasattr(cell.cell_contents, "cache_clear"):
            cell.cell_contents.cache_clear()
