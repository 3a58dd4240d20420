"""Backends, the devices they put ranks on, and what the parent can decide before any rank starts."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl", "threaded")
LAUNCHES = ("pool", "spawn")


class HarnessUsageError(ValueError):
    """Bad input from the user: reported as one clear line, never a traceback from inside torch."""


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise HarnessUsageError(f"unknown backend {backend!r}; choose one of: {', '.join(BACKENDS)}")
    return backend


def check_world_size(world_size) -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise HarnessUsageError(f"invalid world size {world_size!r}: it must be an integer >= 1")
    return world_size


def thread_device_type() -> str:
    """Threaded ranks live on the CPU unless SHARDCHECK_THREAD_DEVICE=cuda puts them all on cuda:0."""
    return os.environ.get("SHARDCHECK_THREAD_DEVICE", "cpu")


def device_for(backend: str, local_rank: int) -> torch.device:
    if backend == "nccl":
        return torch.device("cuda", local_rank)
    if backend == "threaded":
        kind = thread_device_type()
        return torch.device(kind, 0) if kind == "cuda" else torch.device("cpu")
    return torch.device("cpu")


def skip_reason(backend: str, world_size: int) -> str | None:
    """Why this (backend, world size) cannot run on this machine, or None if it can."""
    if not dist.is_available():
        return "torch.distributed is not available in this torch build"
    if backend == "gloo" and not dist.is_gloo_available():
        return "gloo backend is not available in this torch build"
    if backend == "nccl":
        if not dist.is_nccl_available():
            return "nccl backend is not available in this torch build (CPU-only torch?)"
        count = torch.cuda.device_count()
        if count < world_size:
            return f"nccl at world size {world_size} needs {world_size} CUDA devices; {count} visible"
    if backend == "threaded" and thread_device_type() == "cuda" and not torch.cuda.is_available():
        return "SHARDCHECK_THREAD_DEVICE=cuda but no CUDA device is visible"
    return None


def start_method(backend: str) -> str:
    """fork is fastest; forkserver (with torch preloaded) is the safe choice once CUDA is involved."""
    forced = os.environ.get("SHARDCHECK_START_METHOD")
    if forced:
        return forced
    if backend == "nccl" or (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return "forkserver"
    return "fork"
