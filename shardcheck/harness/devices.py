"""Which device each rank uses, and GPU leasing.

A rank's device (`device_for`): cuda:<local rank> under nccl; under the threaded backend the CPU,
or cuda:0 for every rank with SHARDCHECK_THREAD_DEVICE=cuda; else the CPU.

Leasing: every test takes the devices it needs for as long as it runs, from one lease shared by
all the processes of a session (pytest-xdist workers) and by concurrent sessions on the machine.
A device is a lock file, `<lease dir>/device-<id>.lock`, held with `fcntl.flock` (released by the
kernel when its holder dies: a killed worker never leaves a device taken). `<id>` is the device's
entry in the outer `CUDA_VISIBLE_DEVICES` (an index or a UUID), so two sessions restricted to
overlapping device lists still exclude each other. A test at world size W takes W devices at once:
the taker first holds `gate.lock` (so a large request is not starved by small ones slipping in), then
takes free devices without blocking until it has W, sleeping while others run; it never holds a
device while it waits for the gate, so there is no deadlock. Ranks then see exactly their lease
(`CUDA_VISIBLE_DEVICES=<the W ids>`, set in each rank before CUDA initialises; rank r uses cuda:r).

`SHARDCHECK_FAKE_GPUS=N` pretends N devices are visible (ids fake0..fakeN-1, a private lease dir per
session) and leases devices to gloo tests too: the leasing is testable on a CPU machine.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
import time

from shardcheck.harness.vocabulary import LAUNCHES
from shardcheck.errors import ShardcheckError

FAKE_ENV = "SHARDCHECK_FAKE_GPUS"
DIR_ENV = "SHARDCHECK_LEASE_DIR"
POLL_S = 0.05


class LeaseTimeout(ShardcheckError, RuntimeError):
    pass


def thread_device_type() -> str:
    """Threaded ranks live on the CPU unless SHARDCHECK_THREAD_DEVICE=cuda puts them all on cuda:0."""
    return os.environ.get("SHARDCHECK_THREAD_DEVICE", "cpu")


def device_for(backend: str, local_rank: int):
    """The torch.device of the rank with this local rank."""
    import torch

    if backend == "nccl":
        return torch.device("cuda", local_rank)
    if backend == "threaded":
        kind = thread_device_type()
        return torch.device(kind, 0) if kind == "cuda" else torch.device("cpu")
    return torch.device("cpu")


def settle_numerics(device) -> None:
    """On a GPU, the yardstick and the implementation compute alike in the same rank only with the
    same kernels every time: TF32 off for matmuls and convolutions (cuDNN's default is on) and
    deterministic kernels (cuDNN's choice fixed, cuBLAS's workspace split the same way; an op with no
    deterministic kernel warns). The checks' tolerances are float32's, not TF32's 10-bit mantissa
    (shardcheck/conformance/checks/support/compare.py). Nothing changes on the CPU."""
    if device.type != "cuda":
        return
    import torch

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS starts: deterministic
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.use_deterministic_algorithms(True, warn_only=True)


def _lease_timeout(count: int, timeout_s: float) -> LeaseTimeout:
    return LeaseTimeout(f"could not lease {count} devices within {timeout_s:g} s (other tests held them)")


def fake_count() -> int | None:
    raw = os.environ.get(FAKE_ENV)
    return int(raw) if raw else None


def visible_devices() -> list[str]:
    """The ids of the devices this session may use: the outer CUDA_VISIBLE_DEVICES entries (or
    0..count-1 when it is unset), or the fake ones."""
    fake = fake_count()
    if fake is not None:
        return [f"fake{i}" for i in range(fake)]
    from shardcheck.harness import cuda  # here: a session that only learns the word `-n gpus` imports less

    count = cuda.device_count()  # by NVML: this process forks ranks (shardcheck.harness.cuda)
    outer = os.environ.get("CUDA_VISIBLE_DEVICES")
    if outer is not None and outer.strip():
        return [d.strip() for d in outer.split(",") if d.strip()][:count]
    return [str(i) for i in range(count)]


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask where the platform has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def worker_count() -> tuple[int, str]:
    """How many xdist workers `-n gpus` means, and the header line saying why."""
    ids = visible_devices()
    if ids:
        kind = "fake GPUs" if fake_count() is not None else "GPUs"
        return len(ids), f"-n gpus: {len(ids)} workers, one per visible device ({len(ids)} {kind})"
    cores = usable_cpus()
    n = max(1, cores // 2)
    return n, f"-n gpus: no GPU visible; {n} worker{'s' if n > 1 else ''} (half of {cores} cores)"


def leasing_applies(backend: str, mode: str) -> bool:
    """Tests lease devices when their ranks are processes on GPUs (nccl), or on fake GPUs."""
    if mode not in LAUNCHES:
        return False  # thread ranks share one process; external ranks' devices belong to the launcher
    return backend == "nccl" or fake_count() is not None


def lease_dir() -> str:
    """The session's lease directory: $SHARDCHECK_LEASE_DIR (set by the controller for its xdist
    workers, see `prepare`), else one per user on the machine."""
    path = os.environ.get(DIR_ENV) or os.path.join(tempfile.gettempdir(), f"shardcheck-devices-{os.getuid()}")
    os.makedirs(path, exist_ok=True)
    return path


def prepare() -> str | None:
    """Called once by the controlling pytest process; xdist workers inherit the environment.
    Fake devices get a private directory so that they never collide with a real session: its path,
    for :func:`finish` (None when none was made)."""
    if fake_count() is not None and not os.environ.get(DIR_ENV):
        os.environ[DIR_ENV] = tempfile.mkdtemp(prefix="shardcheck-fake-devices-")
        return os.environ[DIR_ENV]
    return None


def finish(made: str | None) -> None:
    """At the controller's end: the private directory `prepare` made goes, with its lock files."""
    if made is not None:
        shutil.rmtree(made, ignore_errors=True)
        if os.environ.get(DIR_ENV) == made:
            del os.environ[DIR_ENV]


def _try_lock(path: str) -> int | None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _unlock(fd: int) -> None:
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


@contextlib.contextmanager
def lease(count: int, timeout_s: float, prefer: list[str] | None = None):
    """Hold `count` devices (their ids, in rank order) for the duration of the block. `prefer`: the
    devices a live pool already sits on, taken first when free so that the pool can be reused."""
    ids = visible_devices()
    if count > len(ids):
        raise LeaseTimeout(f"needs {count} devices; {len(ids)} visible")
    order = [d for d in (prefer or []) if d in ids] + [d for d in ids if d not in (prefer or [])]
    root = lease_dir()
    held: dict[str, int] = {}
    gate = os.open(os.path.join(root, "gate.lock"), os.O_RDWR | os.O_CREAT, 0o666)
    try:
        deadline = time.monotonic() + timeout_s
        while True:  # the gate, without blocking past the deadline
            try:
                fcntl.flock(gate, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise _lease_timeout(count, timeout_s) from None
                time.sleep(POLL_S)
        try:
            while len(held) < count:
                for dev in order:
                    if dev not in held and len(held) < count:
                        fd = _try_lock(os.path.join(root, f"device-{dev}.lock"))
                        if fd is not None:
                            held[dev] = fd
                if len(held) < count:
                    if time.monotonic() > deadline:
                        raise _lease_timeout(count, timeout_s)
                    time.sleep(POLL_S)
        finally:
            fcntl.flock(gate, fcntl.LOCK_UN)
        yield [d for d in order if d in held]
    finally:
        os.close(gate)
        for fd in held.values():
            _unlock(fd)
