"""What a process that forks ranks may learn of CUDA without initialising it.

The rule: **a process that forks ranks never initialises the CUDA driver.** A forked child of a
process that did cannot use CUDA at all: its first CUDA call raises "CUDA error: initialization
error", and torch calls into CUDA on its own wherever CUDA is available (every `optimizer.step()`
asks whether the current stream is capturing a graph). `torch.cuda.is_available()`,
`torch.accelerator.current_accelerator()` and, where NVML is missing, `torch.cuda.device_count()` ask
the CUDA runtime (`cudaGetDeviceCount`), which initialises the driver (`cuInit`) even though
`torch.cuda.is_initialized()` stays False.

So the harness, the report writer and the CLI ask here instead:

- `device_count()` and `device_names()` read NVML (`libnvidia-ml.so.1`, as torch does under
  `PYTORCH_NVML_BASED_CUDA_CHECK=1`): no CUDA context, safe to fork after. Where NVML cannot be read
  on a build of torch with CUDA, one child Python asks torch and exits (once per process).
- `driver_touched()` tells whether this process initialised the driver anyway (a user's conftest,
  an engine's import, a threaded test on cuda:0 or torch's optimizer in a thread rank): the pool then
  starts its ranks from a fork server (`shardcheck.harness.pool.start_method`), which never did.

tests/harness/test_cuda_rule.py spies on torch's CUDA entry points in a whole `shardcheck run` and
fails when the parent calls one.
"""

from __future__ import annotations

import ctypes
import functools
import os
import subprocess
import sys

NVML_LIBRARY = "libnvidia-ml.so.1"
DRIVER_LIBRARY = "libcuda.so"  # what cuInit loads; libcudart.so (linked by torch) does not match


def built() -> bool:
    """Whether this torch was built with CUDA (a compile-time fact: initialises nothing)."""
    import torch

    return bool(torch.backends.cuda.is_built())


def visible_count(raw_count: int, env: str | None) -> int:
    """How many of `raw_count` devices CUDA_VISIBLE_DEVICES=`env` leaves visible: the leading
    entries that name a device (an index below the count, or a UUID), as the CUDA runtime reads it."""
    if env is None:
        return raw_count
    seen = 0
    for entry in (e.strip() for e in env.split(",")):
        if entry.isdigit():
            if int(entry) >= raw_count:
                break
        elif not entry.startswith(("GPU-", "MIG-")):
            break  # an empty or invalid entry ends the list
        seen += 1
    return seen


def _nvml_devices() -> list[str] | None:
    """The names of the machine's NVIDIA devices by NVML, or None where NVML cannot be read."""
    try:
        nvml = ctypes.CDLL(NVML_LIBRARY)
    except OSError:
        return None
    if nvml.nvmlInit_v2() != 0:
        return None
    try:
        count = ctypes.c_uint()
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return None
        names = []
        for index in range(count.value):
            handle, name = ctypes.c_void_p(), ctypes.create_string_buffer(96)
            if nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) != 0 or \
                    nvml.nvmlDeviceGetName(handle, name, len(name)) != 0:
                return None
            names.append(name.value.decode(errors="replace"))
        return names
    finally:
        nvml.nvmlShutdown()


@functools.lru_cache(maxsize=None)
def _asked_in_a_child(env: str | None) -> int:
    """torch.cuda.device_count() in a child Python: it may initialise the driver, there only."""
    done = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                          capture_output=True, text=True, timeout=120, check=False)
    try:
        return int(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return 0


def device_names() -> list[str]:
    """The names of the CUDA devices this process may see (CUDA_VISIBLE_DEVICES applied), in order;
    empty on a build of torch without CUDA. Never initialises the driver here."""
    if not built():
        return []
    names = _nvml_devices()
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if names is None:
        return ["CUDA device"] * _asked_in_a_child(env)
    visible = visible_count(len(names), env)
    if env is None:
        return names
    picked = []
    for entry in [e.strip() for e in env.split(",")][:visible]:
        picked.append(names[int(entry)] if entry.isdigit() else "CUDA device")
    return picked


def device_count() -> int:
    """How many CUDA devices this process may see; 0 on a build of torch without CUDA."""
    return len(device_names())


def library_mapped(maps_path: str) -> bool:
    try:
        with open(maps_path) as maps:
            return any(DRIVER_LIBRARY in line for line in maps)
    except OSError:
        return False


def driver_touched(maps_path: str = "/proc/self/maps") -> bool:
    """Whether this process initialised CUDA: torch's own lazy init, or the driver library mapped
    (the CUDA runtime loads it at its first call, `cudaGetDeviceCount` included)."""
    if not built():
        return False
    import torch

    return torch.cuda.is_initialized() or library_mapped(maps_path)
