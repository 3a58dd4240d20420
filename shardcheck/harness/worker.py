"""The main loop of one rank process (pool and spawn modes).

A rank joins the process group once, then runs tasks sent by the parent until told to stop. It never
outlives the parent: the kernel kills it when its parent dies (PR_SET_PDEATHSIG) and a watchdog
thread exits it if the owning pytest process disappears (covers forkserver, whose parent is not pytest).
SIGUSR1 makes it write every thread's Python stack to its stack file (used when a test hangs).
"""

from __future__ import annotations

import ctypes
import datetime
import faulthandler
import os
import signal
import sys
import threading
import time

from shardcheck.harness import collector
from shardcheck.harness.output import output_path

PR_SET_PDEATHSIG = 1


def die_with(owner_pid: int) -> None:
    """This process ends when process ``owner_pid`` (its parent) does, however that ends: the kernel
    kills it (PR_SET_PDEATHSIG, Linux), and a watchdog thread checks twice a second elsewhere."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass  # not Linux: the watchdog below still applies

    def watchdog():
        while True:
            try:
                os.kill(owner_pid, 0)
            except ProcessLookupError:
                os._exit(70)
            time.sleep(0.5)

    threading.Thread(target=watchdog, name="shardcheck-watchdog", daemon=True).start()


def pin_to_one_cpu(rank: int, world_size: int) -> None:
    """Keep every thread of this rank (the Python thread, gloo's I/O loop and worker threads, and
    those started later, which inherit the mask) on one CPU of those allowed: `cpu_of`.

    A gloo collective is a chain of small messages, each waking the receiver's I/O thread and then
    the thread waiting in the collective; with more ranks than cores, free to float, those wake-ups
    bounce between cores and queue behind other ranks. Pinned, the reference matrix's clip_grad and
    train_parity families at world size 4 on more ranks than cores take about half the time
    (`python -m shardcheck.conformance.matrix_bench` measures the whole matrix). A world of 2 is left free:
    unpinned, its collectives are quicker and cost less CPU per rank
    (`python -m shardcheck.harness.collective_bench`), and so do the gloo checks; both its ranks on
    their xdist worker's one CPU cost the matrix the same CPU and 5 s more wall. The figures:
    docs/speed.md. Unpinned ranks also meet torch's races more often: F67 (gloo's functional all-gathers in
    flight together corrupting the heap) aborted FSDP2's TwoTensor cells 2 times in 43 unpinned runs,
    0 in 40 pinned, until the adapters stopped reading through that path. SHARDCHECK_PIN_RANKS=0 turns
    pinning off.
    """
    if hasattr(os, "sched_setaffinity"):  # Linux
        pin_threads({cpu_of(rank, world_size, xdist_worker(), sorted(os.sched_getaffinity(0)))})


def xdist_worker() -> int:
    """This process's pytest-xdist worker number (PYTEST_XDIST_WORKER "gwN", inherited by its ranks);
    0 outside xdist."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    return int(worker) if worker.isdigit() else 0


def cpu_of(rank: int, world_size: int, worker: int, allowed: list[int]) -> int:
    """The CPU of `rank` in a world of `world_size` started by xdist worker number `worker`: the
    workers' worlds side by side, ``allowed[(worker * world_size + rank) % len(allowed)]``, so that
    concurrent worlds share a CPU only when their ranks outnumber the CPUs (four workers' worlds of 4 on
    16 CPUs: one CPU each, not all sixteen ranks on the first four)."""
    return allowed[(worker * world_size + rank) % len(allowed)]


def pin_threads(cpus: set[int]) -> None:
    """Every thread of this process, and those it starts later (they inherit the mask), on `cpus`."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:
            pass  # a thread that just ended


CPU_BACKENDS = ("gloo",)  # their ranks compute on the CPU (shardcheck.harness.devices.device_for)
SEE_CUDA_ENV = "SHARDCHECK_GLOO_SEES_CUDA"


def hide_cuda() -> None:
    """A rank that computes on the CPU sees no CUDA device, as on a CPU machine: torch then never
    calls into CUDA for it (every optimizer step asks the driver otherwise), and its verdicts are
    those of the committed CPU reports. SHARDCHECK_GLOO_SEES_CUDA=1 leaves the devices visible."""
    if os.environ.get(SEE_CUDA_ENV) != "1":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


def launcher_env(rank: int, world_size: int) -> dict[str, str]:
    """What torchrun gives a rank on one node, so engines that read it (DeepSpeed asserts LOCAL_RANK;
    Accelerate, Lightning) find it. No MASTER_ADDR/PORT: the rendezvous is a FileStore, no TCP."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size), "GROUP_RANK": "0"}


def rank_main(rank: int, world_size: int, backend: str, store_path: str, conn, owner_pid: int,
              stack_path: str, pg_timeout_s: float, mode: str = "pool",
              visible_devices: str | None = None, *, state, gate) -> None:
    """`state`: the pool's shared array; this rank's slot is +n while it runs test n, -n after.
    `gate`: the pool's barrier, where every rank waits for the others before each body."""
    if visible_devices is not None:  # the leased devices, before anything initialises CUDA here
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices
    elif backend in CPU_BACKENDS:
        hide_cuda()
    os.environ.update(launcher_env(rank, world_size))
    die_with(owner_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    stack_file = open(stack_path, "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    # Everything the rank prints (Python, C++ aborts, gloo) goes to its own file: the parent shows
    # a failed rank's output from that test, also when the rank died (nothing lost in a crash).
    output = os.open(output_path(stack_path), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(output, 1)
    os.dup2(output, 2)
    # (pytest's capture may have replaced sys.stdout/err in the parent we were forked from)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    faulthandler.enable(file=sys.stderr, all_threads=True)  # a fatal signal's Python stack, too

    import torch
    import torch.distributed as dist

    # What this rank inherited or imported so far (torch, the preloaded modules: some 300,000
    # objects) is never garbage: frozen, a full collection no longer walks it.
    collector.fewer_collections()  # a spawned rank starts with CPython's thresholds
    collector.freeze_the_long_lived()

    from shardcheck.harness.context import RankContext
    from shardcheck.harness.devices import device_for, settle_numerics
    from shardcheck.harness.isolation import Baseline, Settings, settle
    from shardcheck.harness.ledger import CollectiveLedger
    from shardcheck.harness.task import execute, reset_process_state

    # One intra-op thread per rank: ranks already share the cores, and a forked child must never
    # enter an OpenMP parallel region whose thread pool the parent created (libgomp is not fork-safe:
    # the child deadlocks, seen as a rank stuck in layer_norm after thread-mode tests ran in the parent).
    # A lock held at the fork by a thread of the parent is the other hazard: thread mode returns only
    # once its rank threads and their OpenMP workers have ended (threads.wait_for_os_exit).
    torch.set_num_threads(1)
    device = device_for(backend, rank)
    settle_numerics(device)
    kwargs = {}
    if backend == "nccl":
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=pg_timeout_s), **kwargs)
    if backend == "gloo" and world_size > 2 and os.environ.get("SHARDCHECK_PIN_RANKS", "1") != "0":
        pin_to_one_cpu(rank, world_size)
    # What every test finds, whatever the one before changed (shardcheck.harness.isolation)
    ledger = CollectiveLedger()  # its wrappers are part of the baseline
    settings, before = Settings.capture(), Baseline.take()
    conn.send(("ready", rank))
    meshes: dict = {}  # sub-groups live as long as the process: built once, reused by every test
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            break
        if task is None:
            break
        state[rank] = task.seq
        reset_process_state(task.seed)
        ctx = RankContext(rank=rank, world_size=world_size, backend=backend, device=device,
                          mode=mode, _meshes=meshes)
        gate.wait()  # every rank is alive and between tests before the body starts
        result = execute(task, ctx)
        settle(result, before, ledger)
        sys.stdout.flush()
        sys.stderr.flush()
        state[rank] = -task.seq  # idle from here on: a death now belongs to this test
        conn.send(result)
        settings.restore()  # for the next test, while the parent reads this one's verdict
    try:
        dist.destroy_process_group()
    finally:
        os._exit(0)
