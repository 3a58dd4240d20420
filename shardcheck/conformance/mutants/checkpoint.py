"""Mutants of the reference's checkpoints (shardcheck/reference_impl/checkpoint.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from shardcheck.conformance.mutants.base import MutantAdapter, replace

RESUME_CHECKS = ("test_checkpoint.py::test_resume", "test_checkpoint.py::test_resume_loss_scaling",
                 "test_checkpoint_reshard.py::test_reshard")


class CheckpointStepReset(MutantAdapter):
    """Adam's step count not saved: the load restores the moments but the step restarts at 0, so the
    bias correction ``1 - beta^t`` of every later update is that of a fresh optimizer."""

    name = "mutant-ckpt-step-reset"
    bug = "optimizer step count not saved (restarts at 0 after a load)"
    checks = RESUME_CHECKS
    world_sizes = (2, 4)

    def patch(self) -> None:
        from shardcheck.reference_impl import checkpoint

        original = checkpoint.optimizer_pieces

        def without_step(optimizer, shard):
            state = original(optimizer, shard)
            if "step" in state:
                state["step"] = torch.zeros_like(state["step"])
            return state

        replace(checkpoint, "optimizer_pieces", without_step)


class CheckpointScalerNotRestored(MutantAdapter):
    """The grad scaler's state is saved but not restored: after a load the scale is back at its
    initial value and the growth tracker at 0."""

    name = "mutant-ckpt-scaler-not-restored"
    bug = "loss scale and growth tracker not restored on load"
    checks = ("test_checkpoint.py::test_resume_loss_scaling",)

    def patch(self) -> None:
        from shardcheck.reference_impl import checkpoint

        replace(checkpoint, "restore_scaler", lambda scaler, state: None)


class CheckpointOptimStateNotResharded(MutantAdapter):
    """Parameters are resharded but each rank takes its optimizer state from the file of the rank with
    its own number: right at the saved world size only (Adam's moments keyed to the wrong rows)."""

    name = "mutant-ckpt-optim-state-not-resharded"
    bug = "optimizer state not resharded (own rank's file) at another world size"
    checks = ("test_checkpoint_reshard.py::test_reshard",)
    world_sizes = (4,)

    def patch(self) -> None:
        from shardcheck.reference_impl import checkpoint

        def own_file(optimizer, name, unit, sp, pieces):
            rank = unit.shard_rank
            if rank < len(pieces) and pieces[rank][1]:
                optimizer.state[sp.shard] = {k: v.clone() if torch.is_tensor(v) else v
                                             for k, v in pieces[rank][1].items()}

        replace(checkpoint, "load_optimizer_state", own_file)


class CheckpointExportLocalShard(MutantAdapter):
    """The "full" state dict is this rank's shards: a consolidated export that silently is not."""

    name = "mutant-ckpt-export-local-shard"
    bug = "full_state_dict returns the local shards"
    checks = ("test_checkpoint.py::test_consolidated_export",)

    def patch(self) -> None:
        from shardcheck.reference_impl import checkpoint

        replace(checkpoint, "full_state_dict", lambda model: {n: t.detach().clone()
                                                             for n, t in model.state_dict().items()})


class CheckpointLoadUnchecked(MutantAdapter):
    """Load trusts the checkpoint: no size check of the rank files and no shape check against the
    model, so a truncated file or another model's checkpoint fails deep in torch (an error that names
    neither the file nor the parameter) or loads."""

    name = "mutant-ckpt-load-unchecked"
    bug = "load does not validate files and shapes (errors name nothing)"
    checks = ("test_checkpoint.py::test_bad_input",)

    def patch(self) -> None:
        from shardcheck.reference_impl import checkpoint

        replace(checkpoint, "check_fits", lambda path, meta, shards: None)
        replace(checkpoint, "read_rank_files", lambda path, meta: [
            torch.load(path / name, map_location="cpu", weights_only=True) for name in meta["files"]])


class CheckpointDigestUnchecked(MutantAdapter):
    """Load checks each rank file's size but not its SHA-256: bytes altered in place at the same size
    load silently, as torch.load does not check its zip records' CRC (what DCP does: F60)."""

    name = "mutant-ckpt-digest-unchecked"
    bug = "load checks file sizes, not digests (bytes flipped in place load silently)"
    checks = ("test_checkpoint.py::test_bad_input",)
    cells = ("test_bad_input[*-flipped]",)

    def patch(self) -> None:
        from shardcheck.reference_impl import checkpoint

        replace(checkpoint, "sha256", lambda file: "not computed")


class CheckpointIndexErrorUnnamed(MutantAdapter):
    """The index is parsed without naming it on failure: a truncated meta.json raises json's
    "Expecting ... line 1 column ..." with no file name (as DeepSpeed's and torch's loaders do for
    their files: F61, F32)."""

    name = "mutant-ckpt-index-error-unnamed"
    bug = "a corrupt index raises the parser's error, naming no file"
    checks = ("test_checkpoint.py::test_bad_input",)
    cells = ("test_bad_input[*-truncated_index]",)

    def patch(self) -> None:
        import json

        from shardcheck.reference_impl import checkpoint

        replace(checkpoint, "read_meta", lambda path: json.loads((path / checkpoint.META).read_text()))


class CheckpointLoadWritesWorkingDir(MutantAdapter):
    """Load stages what it reads at a relative path (a lock or staging file, as a loader that
    downloads or unpacks first): the user's working directory collects one per rank."""

    name = "mutant-ckpt-load-writes-cwd"
    bug = "load leaves a staging file in the working directory"
    checks = ("test_checkpoint.py::test_bad_input",)

    def patch(self) -> None:
        import torch.distributed as dist

        from shardcheck.reference_impl import checkpoint

        original = checkpoint.read_meta

        def staged(path):
            Path(f".load-stage-rank{dist.get_rank()}").write_text(str(path))
            return original(path)

        replace(checkpoint, "read_meta", staged)


class CheckpointHybridReplicaNotRestored(MutantAdapter):
    """Under HYBRID_SHARD the load restores the optimizer state on the first replica only (whose
    ranks wrote the rows); the other replica keeps a fresh optimizer: what F65 shows for Lightning's
    FSDPStrategy, in one replica."""

    name = "mutant-ckpt-hybrid-replica-fresh"
    bug = "HYBRID_SHARD: optimizer state restored on the first replica only"
    checks = ("test_checkpoint.py::test_resume_hybrid",)
    world_sizes = (4,)

    def patch(self) -> None:
        import torch.distributed as dist

        from shardcheck.reference_impl import checkpoint

        original = checkpoint.load_optimizer_state

        def first_replica_only(optimizer, name, unit, sp, pieces):
            second = unit.replicate_group is not None and dist.get_rank(unit.replicate_group) > 0
            if not second:
                original(optimizer, name, unit, sp, pieces)

        replace(checkpoint, "load_optimizer_state", first_replica_only)
