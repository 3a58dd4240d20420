"""Interrupted training, judged against the uninterrupted unsharded trajectory (family checkpoint).

`train_across_checkpoint` runs `save_steps` steps on the first `save_size` ranks, saves with the
candidate's own `Trainer.save`, builds a FRESH model (another seed, so that a load that restores
nothing shows) and trainer on the first `load_size` ranks, `Trainer.load`s, and runs `load_steps`
more. Every step of both phases is compared (`parity.compare_steps`) with one unsharded
data-parallel run, `DataParallelReference`, whose data-parallel world is the ranks of the phase:

    phase 1, steps 0..k-1:    g_t = (1/S) * sum_{r<S} grad(loss_r(t))      S = save_size
    phase 2, steps k..k+m-1:  g_t = (1/L) * sum_{r<L} grad(loss_r(t))      L = load_size

The reference itself is not checkpointed through any engine: its parameters, optimizer state (Adam's
step and moments) and GradScaler state (scale, growth tracker) pass from phase 1 to phase 2 in
memory (rank 0's copy, broadcast: it is replicated). So right after the load the parameters and the
optimizer state (`Trainer.full_optimizer_state`, tensor by tensor: Adam's step and moments) must
equal the uninterrupted run's, and then gradients, losses, loss scales and skip decisions must
continue exactly as if training had never stopped.

Two world sizes in one launch: the test runs at max(S, L) ranks and a phase at fewer ranks runs on
the sub-group of the first ranks with its own 1-D device mesh (`phase`); the other ranks wait. The
engines are built on that mesh as on any other, so the phase is an honest smaller world.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import re
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from shardcheck.conformance.checks.support.compare import assert_close
from shardcheck.conformance.checks.support.dp_reference import DataParallelReference
from shardcheck.conformance.checks.support.parity import compare_steps
from shardcheck.conformance.protocol import Recipe, ShardSpec, Unsupported

_MESHES: dict = {}  # (rank, ranks) -> DeviceMesh: sub-groups built once per rank process


def phase(ctx, size: int):
    """(a context over the first `size` ranks of the test, its 1-D mesh), or (None, None) on the
    ranks outside. Collective over ALL the test's ranks (a new process group needs every rank)."""
    if size == ctx.world_size:
        return ctx, ctx.mesh()
    if size > ctx.world_size:
        raise ValueError(f"a phase of {size} ranks in a test of {ctx.world_size}")
    ranks = (dist.get_process_group_ranks(ctx.group) if ctx.group is not None
             else list(range(ctx.world_size)))[:size]
    key = (ctx.rank, tuple(ranks))
    mesh = _MESHES.get(key) if not ctx.is_threaded else None
    if mesh is None:
        mesh = DeviceMesh(ctx.device.type, torch.tensor(ranks))
        if not ctx.is_threaded:
            _MESHES[key] = mesh
    if ctx.rank >= size:
        return None, None
    return dataclasses.replace(ctx, world_size=size, group=mesh.get_group()), mesh


def _reference_state(ref: DataParallelReference | None):
    if ref is None:
        return None
    return (ref.master.state_dict(), ref.optimizer.state_dict(),
            None if ref.scaler is None else ref.scaler.state_dict())


def _continue_reference(ctx, state, model, spec, recipe) -> DataParallelReference:
    ref = DataParallelReference(copy.deepcopy(model), spec, recipe, ctx.group)
    params, optimizer, scaler = state
    ref.master.load_state_dict(params)
    ref.optimizer.load_state_dict(optimizer)
    if scaler is not None:
        ref.scaler.load_state_dict(scaler)
    return ref


def train_across_checkpoint(ctx, impl, workload, recipe: Recipe, path: Path, *, save_size: int,
                            load_size: int, save_steps: int = 2, load_steps: int = 2,
                            spec_of=None, poison: dict | None = None,
                            dtype: torch.dtype | None = None) -> list:
    """Both phases (module docstring), compared step by step; the reference's StepResults of the
    steps this rank ran. `spec_of(mesh)` is the ShardSpec of a phase (default FULL_SHARD on
    `workload.units`); `poison` as in workloads (step -> value on rank 1); `dtype`: the
    tolerance's dtype (default: that of the expected values)."""
    spec_of = spec_of or (lambda mesh: ShardSpec(units=workload.units, mesh=mesh))
    steps = save_steps + load_steps
    results, handed = [], [None]
    first, first_mesh = phase(ctx, save_size)
    second, second_mesh = phase(ctx, load_size)

    def save_phase():
        if first is None:
            return
        with first.seeded(0):
            model = workload.build().to(ctx.device)
        spec = spec_of(first_mesh)
        ref = DataParallelReference(copy.deepcopy(model), spec, recipe, first.group)
        trainer = impl.trainer(model, spec, recipe)
        try:
            batches = workload.batches(first, steps, poison=poison)[:save_steps]
            results.extend(compare_steps(first, trainer, ref, recipe, batches, dtype))
            trainer.save(path)
        finally:
            if hasattr(trainer, "close"):
                trainer.close()
        handed[0] = _reference_state(ref)

    # A rank that fails in a phase fails the test (the harness stops the others); one that the
    # implementation refuses (Unsupported) tells the ranks outside the phase, which wait for it.
    refused = _refusal(save_phase)
    state = _agreed(ctx, (handed[0], refused))

    def load_phase():
        if second is None:
            return
        with second.seeded(1):  # not phase 1's initial values: the load must restore them
            model = workload.build().to(ctx.device)
        spec = spec_of(second_mesh)
        ref = _continue_reference(second, state, model, spec, recipe)
        trainer = impl.trainer(model, spec, recipe)
        try:
            trainer.load(path)
            assert_close(second, trainer.full_params(), ref.full_params(), "parameters after load", dtype=dtype)
            assert_close(second, as_tensors(trainer.full_optimizer_state()), optimizer_state(ref),
                         "optimizer state after load", dtype=dtype)
            batches = workload.batches(second, steps, poison=poison)[save_steps:]
            results.extend(compare_steps(second, trainer, ref, recipe, batches, dtype, first=save_steps))
        finally:
            if hasattr(trainer, "close"):
                trainer.close()

    _agreed(ctx, (None, _refusal(load_phase)))
    return results


def trained_and_exported(ctx, impl, build, spec: ShardSpec, recipe: Recipe, batches: list) -> tuple[dict, DataParallelReference]:
    """`build()` (seed 0) trained on `batches` by the candidate and by unsharded data-parallel training,
    compared after every step (parity.compare_steps), then the candidate's consolidated export
    (`Trainer.full_state_dict`): (the export, the yardstick, whose `master` holds the unsharded run's
    state). The family checkpoint's and the zoo's export checks (test_checkpoint.py,
    test_models_loaded.py) judge the export against it."""
    with ctx.seeded(0):
        model = build().to(ctx.device)
    reference = DataParallelReference(copy.deepcopy(model), spec, recipe, ctx.group)
    trainer = impl.trainer(model, spec, recipe)
    try:
        compare_steps(ctx, trainer, reference, recipe, batches)
        return trainer.full_state_dict(), reference
    finally:
        if hasattr(trainer, "close"):
            trainer.close()


def _refusal(run_phase) -> str | None:
    """`run_phase()`; the message of an Unsupported it raised (rank 0 is in every phase), else None."""
    try:
        run_phase()
    except Unsupported as refused:
        return refused.reason
    return None


def _agreed(ctx, handed: tuple):
    """Rank 0's (value, refusal) on every rank of the test, in one broadcast of one object (what the
    ranks outside a phase wait in, also when an engine's bug sends them a collective of its own:
    F57's hang); the value, or the refusal raised everywhere."""
    box = [handed]
    dist.broadcast_object_list(box, src=dist.get_global_rank(ctx.group, 0) if ctx.group else 0, group=ctx.group)
    value, refused = box[0]
    if refused is not None:
        raise Unsupported(refused)
    return value


def optimizer_state(ref: DataParallelReference) -> dict[str, torch.Tensor]:
    """{parameter name: {state key: value}} of the reference's (unsharded) optimizer, as tensors."""
    return as_tensors({n: ref.optimizer.state.get(p, {}) for n, p in ref.master.named_parameters()})


def as_tensors(state: dict[str, dict]) -> dict[str, torch.Tensor]:
    """{"<parameter> <key>": float32 tensor} (Adam's step may be a tensor or a number): one flat
    dict, so that a parameter whose state is missing on one side shows as names that differ."""
    return {f"{n} {k}": torch.as_tensor(v).detach().float().cpu() for n, entry in state.items() for k, v in entry.items()}


def files_under(root: Path) -> dict[str, int]:
    """{relative path: size} of every file under `root`."""
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}


def is_binary(file: Path) -> bool:
    """A NUL byte in the first 8 KiB: shards and indexes are binary; the scripts and tag files some
    engines write beside them (DeepSpeed's zero_to_fp32.py, `latest`) are text."""
    with open(file, "rb") as f:
        return b"\0" in f.read(8192)


def largest_file(root: Path) -> Path:
    """The checkpoint's largest binary file: a data (shard) file in any format, never a small index or
    a script saved beside the checkpoint."""
    sizes = {name: size for name, size in files_under(root).items() if is_binary(root / name)}
    if not sizes:
        raise AssertionError(f"the trainer's save wrote no binary file under {root}")
    return root / max(sizes, key=lambda name: (sizes[name], name))


INDEX = re.compile(r"^\.|meta|latest", re.IGNORECASE)


def index_files(root: Path) -> list[Path]:
    """The checkpoint's index files, by the names the formats give them: DCP's `.metadata`, the
    reference's `meta.json`, Lightning's `meta.pt`, DeepSpeed's `latest` tag (what a load without a
    tag reads)."""
    found = [root / name for name in files_under(root) if INDEX.search(Path(name).name)]
    if not found:
        raise AssertionError(f"the trainer's save wrote no index file under {root}: {sorted(files_under(root))}")
    return found


def flip_bytes(file: Path, count: int = 4) -> None:
    """Invert `count` bytes in the middle of `file`, keeping its size (a bit rot, a bad copy)."""
    data = bytearray(file.read_bytes())
    middle = len(data) // 2
    for i in range(max(0, middle - count // 2), min(len(data), middle + count // 2)):
        data[i] ^= 0xFF
    file.write_bytes(bytes(data))


def truncate(file: Path) -> None:
    """Keep the first half of `file`."""
    size = file.stat().st_size
    with open(file, "r+b") as f:
        f.truncate(size // 2)


def listing(directory: Path) -> set[str]:
    return set(os.listdir(directory))


@contextlib.contextmanager
def working_in(ctx, directory: Path):
    """The ranks' working directory is `directory` (made if missing) for the block: what an engine
    writes at a relative path lands there, not among what others write in the caller's (the run's
    own working directory is shared with every process the machine runs). Threaded ranks share one
    process, whose directory rank 0 changes between barriers."""
    directory.mkdir(parents=True, exist_ok=True)
    mine = not ctx.is_threaded or ctx.rank == 0
    ctx.barrier()
    previous = os.getcwd()
    if mine:
        os.chdir(directory)
    ctx.barrier()
    try:
        yield directory
    finally:
        ctx.barrier()
        if mine:
            os.chdir(previous)
        ctx.barrier()
