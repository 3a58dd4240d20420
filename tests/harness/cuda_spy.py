"""A pytest plugin (`-p cuda_spy`) that records every call to torch's CUDA entry points made in the
session's own process: the process that forks ranks (shardcheck/harness/cuda.py). Ranks are other
processes and may call what they like. The calls, with the frame outside torch that made each, go to
the file named by CUDA_SPY_OUT when the session ends.

On a build of torch without CUDA these functions answer without touching anything, so the spy wraps
them at the Python level: the rule is checked on CPU-only machines too."""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch

# Each of these initialises the CUDA driver on a machine with a GPU (or needs it initialised).
ENTRY_POINTS = {
    torch.cuda: ["is_available", "device_count", "init", "_lazy_init", "current_device", "set_device",
                 "get_device_name", "get_device_properties", "get_device_capability", "synchronize",
                 "mem_get_info", "get_rng_state", "get_rng_state_all", "is_current_stream_capturing"],
    torch.accelerator: ["current_accelerator", "is_available", "device_count", "current_device_index"],
    torch._C: ["_cuda_getDeviceCount", "_cuda_init"],
}
SESSION_PID = os.getpid()
CALLS: list[dict] = []


def _caller() -> str:
    for frame in reversed(traceback.extract_stack()[:-2]):
        if f"{os.sep}torch{os.sep}" not in frame.filename and frame.filename != __file__:
            return f"{frame.filename}:{frame.lineno} {frame.name}"
    return "torch"


def _spy(module, name):
    original = getattr(module, name, None)
    if original is None:
        return

    def spied(*args, **kwargs):
        if os.getpid() == SESSION_PID:
            CALLS.append({"call": f"{module.__name__}.{name}", "from": _caller()})
        return original(*args, **kwargs)

    setattr(module, name, spied)


for _module, _names in ENTRY_POINTS.items():
    for _name in _names:
        _spy(_module, _name)


def pytest_unconfigure(config):
    if os.getpid() == SESSION_PID and os.environ.get("CUDA_SPY_OUT"):
        with open(os.environ["CUDA_SPY_OUT"], "w") as out:
            json.dump(CALLS, out)
    sys.stderr.flush()
