"""Checkpoints of a sharded model, its optimizer and its grad scaler, loadable at any world size.

The format (one directory)::

    rank-<r>.pt   what data-parallel rank r holds: for every parameter its rows [start, end) of the
                  full tensor, the optimizer state it holds and of which rows (those rows, or under
                  SHARD_OPTIMIZER the rows its ShardedOptimizer steps), and the model's buffers
    meta.json     written last, by rank 0: format and version, world size, every parameter's full
                  shape and dtype, every unit's strategy, each rank file's size and SHA-256, the
                  optimizer's hyper-parameters and the grad scaler's state (scale, growth tracker)

Loading at world size ``W'`` rebuilds each full tensor ``full[start:end] = piece`` from the pieces of
every file (replicas, as under NO_SHARD and HYBRID_SHARD, write the same rows twice) and keeps this
rank's rows under the new layout, ``torch.chunk(full, W')[r]``. An optimizer state tensor shaped like
its parameter's shard is sharded by rows like it; any other (Adam's ``step``) is the same on every
rank and taken from rank 0's file. Every rank reads every file (checkpoints of this implementation
are small), so every rank finds the same problem and raises the same error before any collective:
a missing ``meta.json`` or rank file, a file whose size (truncated) or SHA-256 (altered in place:
torch.load does not check its zip records' CRC) differs from the one recorded, one that does not
unpickle, a parameter whose name or shape differs from the model's.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from . import collectives as C
from .optimizer import ShardedOptimizer
from .sharding import unit_of, units
from shardcheck.errors import ShardcheckError

FORMAT, VERSION = "reference_impl-checkpoint", 2
META = "meta.json"


class CheckpointError(ShardcheckError, ValueError):
    """A checkpoint that cannot be loaded into this model: the message names the file or parameter."""


def rank_file(rank: int) -> str:
    return f"rank-{rank}.pt"


def _shards(model: nn.Module) -> dict[str, tuple]:
    """{name: (unit, sharded param)} for every parameter of ``model``."""
    by_id = {id(sp.shard): (u, sp) for u in units(model) for sp in u.params}
    return {name: by_id[id(p)] for name, p in model.named_parameters()}


def _dp_group(model: nn.Module):
    return units(model, adopt=False)[0].dp_group


def saved_rows(unit, sp) -> tuple[int, int]:
    """The rows of the full parameter this rank's shard holds (all of them without a shard group)."""
    return sp.slot.local_rows(unit.shard_rank)


def optimizer_pieces(optimizer: torch.optim.Optimizer, shard: torch.Tensor) -> dict:
    """The optimizer state of one shard, detached copies (tensors shaped like the shard are its rows)."""
    state = optimizer.state_of(shard) if isinstance(optimizer, ShardedOptimizer) else optimizer.state.get(shard, {})
    return {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in state.items()}


def optimizer_rows(optimizer, unit, sp) -> tuple[int, int]:
    """The rows of the full parameter whose optimizer state this rank holds: its shard's, or under
    SHARD_OPTIMIZER (a whole parameter) the rows its ShardedOptimizer steps."""
    return optimizer.rows_of(sp.shard) if isinstance(optimizer, ShardedOptimizer) else saved_rows(unit, sp)


def save(path, model: nn.Module, optimizer: torch.optim.Optimizer, scaler=None) -> None:
    """Write this rank's file; rank 0 writes ``meta.json`` once every rank's file is complete. Collective."""
    path = Path(path)
    group = _dp_group(model)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if rank == 0:
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier(group=group)
    shards = _shards(model)
    pieces = {name: {"rows": saved_rows(u, sp), "value": sp.shard.detach().cpu().clone(),
                     "optimizer": optimizer_pieces(optimizer, sp.shard), "optimizer_rows": optimizer_rows(optimizer, u, sp)}
              for name, (u, sp) in shards.items()}
    payload = {"params": pieces, "buffers": {n: b.detach().cpu().clone() for n, b in model.named_buffers()}}
    torch.save(payload, path / rank_file(rank))
    sizes = [None] * world
    dist.all_gather_object(sizes, (os.path.getsize(path / rank_file(rank)), sha256(path / rank_file(rank))), group=group)
    if rank == 0:
        meta = {
            "format": FORMAT, "version": VERSION, "world_size": world,
            "params": {n: {"shape": list(sp.slot.shape), "dtype": str(sp.shard.dtype).removeprefix("torch.")}
                       for n, (_, sp) in shards.items()},
            "strategies": {path: unit_of(m).strategy.name for path, m in model.named_modules() if unit_of(m)},
            "files": {rank_file(r): size for r, (size, _) in enumerate(sizes)},
            "sha256": {rank_file(r): digest for r, (_, digest) in enumerate(sizes)},
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
            "scaler": None if scaler is None else scaler.state_dict(),
        }
        (path / (META + ".tmp")).write_text(json.dumps(meta, indent=1, default=str))
        os.replace(path / (META + ".tmp"), path / META)
    dist.barrier(group=group)


def sha256(file: Path) -> str:
    return hashlib.sha256(file.read_bytes()).hexdigest()


def read_meta(path: Path) -> dict:
    meta_file = path / META
    if not meta_file.is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint: {META} is missing")
    try:
        meta = json.loads(meta_file.read_text())
    except ValueError as exc:
        raise CheckpointError(f"{meta_file} is truncated or corrupt: {exc}") from exc
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise CheckpointError(f"{meta_file}: not a {FORMAT} v{VERSION} checkpoint "
                              f"(format {meta.get('format')!r}, version {meta.get('version')!r})")
    return meta


def check_fits(path: Path, meta: dict, shards: dict) -> None:
    """Raise unless the checkpoint's parameters are exactly the model's, with the same shapes."""
    saved = meta["params"]
    problems = [f"{n} is missing from the checkpoint" for n in shards if n not in saved]
    problems += [f"{n} is in the checkpoint but not in the model" for n in saved if n not in shards]
    problems += [f"{n} has shape {saved[n]['shape']} in the checkpoint and {list(sp.slot.shape)} in the model"
                 for n, (_, sp) in shards.items() if n in saved and saved[n]["shape"] != list(sp.slot.shape)]
    if problems:
        raise CheckpointError(f"checkpoint {path} does not fit this model: " + "; ".join(problems))


def read_rank_files(path: Path, meta: dict) -> list[dict]:
    out = []
    for name, size in meta["files"].items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path} is missing {name} (a shard file of world size "
                                  f"{meta['world_size']})")
        if os.path.getsize(file) != size:
            raise CheckpointError(f"{file} is truncated or altered: {os.path.getsize(file)} bytes, "
                                  f"{size} when saved")
        if sha256(file) != meta["sha256"][name]:
            raise CheckpointError(f"{file} is corrupt: its SHA-256 differs from the one recorded when saved "
                                  "(altered in place)")
        try:
            out.append(torch.load(file, map_location="cpu", weights_only=True))
        except Exception as exc:
            raise CheckpointError(f"{file} is corrupt: {exc}") from exc
    return out


def assemble(name: str, shape, pieces: list[tuple[tuple[int, int], torch.Tensor]]) -> torch.Tensor:
    """The full tensor of ``shape`` from its (rows, value) pieces; every row must be covered."""
    shape = torch.Size(shape)
    rows = shape[0] if len(shape) else 1
    full = torch.empty((rows, *shape[1:]), dtype=pieces[0][1].dtype)
    covered = torch.zeros(rows, dtype=torch.bool)
    for (start, end), value in pieces:
        full[start:end] = value.reshape(end - start, *shape[1:])
        covered[start:end] = True
    if not covered.all():
        raise CheckpointError(f"{name}: rows {covered.logical_not().nonzero().flatten().tolist()} are in no "
                              f"rank file")
    return full.reshape(shape)


def keep_rows(full: torch.Tensor, unit, sp) -> torch.Tensor:
    """This rank's rows of ``full`` under the current layout."""
    return C.shard_rows(full, C.Slot.of(full.shape, unit.shard_size), unit.shard_rank)


def load(path, model: nn.Module, optimizer: torch.optim.Optimizer, scaler=None) -> None:
    """Load ``path`` (written at any world size) into this rank's shards, optimizer and scaler."""
    path = Path(path)
    meta = read_meta(path)
    shards = _shards(model)
    check_fits(path, meta, shards)
    files = read_rank_files(path, meta)
    if (scaler is None) != (meta["scaler"] is None):
        raise CheckpointError(f"checkpoint {path} was saved {'with' if meta['scaler'] else 'without'} a grad "
                              f"scaler; this trainer has {'one' if scaler else 'none'}")
    with torch.no_grad():
        for name, (u, sp) in shards.items():
            pieces = [(tuple(f["params"][name]["rows"]), f["params"][name]["value"]) for f in files]
            sp.shard.copy_(keep_rows(assemble(name, meta["params"][name]["shape"], pieces), u, sp))
            load_optimizer_state(optimizer, name, u, sp, [(tuple(f["params"][name]["optimizer_rows"]),
                                                           f["params"][name]["optimizer"]) for f in files])
        for name, b in model.named_buffers():
            b.copy_(files[0]["buffers"][name])
    for group, saved in zip(optimizer.param_groups, meta["param_groups"]):
        group.update({k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()})
    if scaler is not None:
        restore_scaler(scaler, meta["scaler"])


def row_sharded(value, sp) -> bool:
    """Whether an optimizer state value is cut by rows like its parameter (Adam's moments; not its step)."""
    return torch.is_tensor(value) and value.dim() > 0 and value.shape[1:] == sp.slot.shape[1:]


def full_optimizer_entry(name: str, sp, pieces: list) -> dict:
    """The full optimizer state of one parameter from every rank's (rows, state): row-sharded tensors
    reassembled, the rest from the first rank holding state ({} where none does)."""
    states = [(rows, state) for rows, state in pieces if state]
    if not states:
        return {}
    return {key: assemble(f"{name} optimizer {key}", sp.slot.shape, [(rows, s[key]) for rows, s in states])
            if row_sharded(first, sp) else (first.clone() if torch.is_tensor(first) else first)
            for key, first in states[0][1].items()}


def load_optimizer_state(optimizer, name: str, unit, sp, pieces: list) -> None:
    """Set ``optimizer.state[shard]``: row-sharded tensors reassembled and re-cut, the rest from rank 0."""
    full = full_optimizer_entry(name, sp, pieces)
    if full and isinstance(optimizer, ShardedOptimizer):
        optimizer.set_state(sp.shard, full)
    elif full:
        optimizer.state[sp.shard] = {k: keep_rows(v, unit, sp).clone().to(sp.shard.device) if row_sharded(v, sp) else v
                                     for k, v in full.items()}


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict]:
    """{parameter name: {state key: full value}} on every rank: what an unsharded optimizer would
    hold. Collective over the data-parallel group."""
    shards = _shards(model)
    group = _dp_group(model)
    mine = {name: (optimizer_rows(optimizer, u, sp), optimizer_pieces(optimizer, sp.shard))
            for name, (u, sp) in shards.items()}
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    return {name: full_optimizer_entry(name, sp, [theirs[name] for theirs in everyone])
            for name, (_, sp) in shards.items()}


def restore_scaler(scaler, state: dict) -> None:
    scaler.load_state_dict(state)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The consolidated state dict (full parameters and buffers, unsharded names), on every rank,
    for ``load_state_dict(strict=True)`` into the unsharded model. Collective."""
    from .full_state import full_state

    params = full_state(model)
    # a tied weight is one parameter under its first name; the state dict names it under each
    first = {id(p): n for n, p in model.named_parameters()}
    alias = {n: first[id(p)] for n, p in model.named_parameters(remove_duplicate=False)}
    return {n: params[alias[n]].clone() if n in alias else t.detach().clone() for n, t in model.state_dict().items()}
