"""Mutants the family models kills (shardcheck/conformance/checks/behaviour/test_models.py), and the
model their runs judge: `tied_tower`, a transformers-free tower whose input embedding is tied to its
output projection, as Llama's `tie_word_embeddings` and GPT-2 tie them (the mutant runs pass it as
the user's own model, `--shardcheck-model`, so they need no transformers)."""

from __future__ import annotations

import torch
import torch.nn as nn

from shardcheck.conformance.mutants.base import MutantAdapter, before_shard, replace, untie_shared

MODELS = "test_models.py::test_model_parity"


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class TiedTower(nn.Module):
    """Embedding(61, 16), two residual blocks, and an output projection sharing the embedding's weight."""

    def __init__(self, vocab: int = 61, width: int = 16, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(_Block(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def tied_tower() -> nn.Module:
    return TiedTower()


class WrappingUnties(MutantAdapter):
    """Wrapping gives each module that holds a shared parameter a Parameter of its own (torchtitan
    SimpleFSDP parametrizes module by module: F24; FSDP1 on meta: F47): a tied output projection
    trains apart from the embedding, on a model built anywhere."""

    name = "mutant-wrapping-unties"
    bug = "a weight two modules share (tied embeddings), untied when the model is wrapped"
    checks = (MODELS,)
    cells = ("test_model_parity[*]",)

    def patch(self) -> None:
        before_shard(lambda module: untie_shared(module, lambda p: nn.Parameter(p.detach().clone(), p.requires_grad)))


class LowLoadUpcast(MutantAdapter):
    """Master shards made float32 whatever dtype the model was loaded in (Accelerate's FSDP upcast
    applied by an engine that promises the weights as loaded, or a cast left in a wrapper): a model
    from `from_pretrained(dtype=torch.bfloat16)` trains float32 master weights, silently. Models
    built in float32 are untouched."""

    name = "mutant-low-load-upcast"
    bug = "master weights upcast to float32 where the engine promises them as loaded (bf16)"
    checks = (MODELS.replace("test_model_parity", "test_bf16_loaded_model"),)
    needs_zoo = True  # the check loads transformers' Llama: its runs need the extra shardcheck[models]

    def patch(self) -> None:
        def upcast(module):
            with torch.no_grad():
                for p in module.parameters():
                    if p.is_floating_point() and p.dtype != torch.float32 and not p.is_meta:
                        p.data = p.data.float()

        before_shard(upcast)


LOADED = "test_models_loaded.py::"


class MetaLoadDropsBuffers(MutantAdapter):
    """A model held by rank 0 loaded into meta skeletons by its state dict alone, rank 0's own model
    moved to meta first (as Accelerate's FSDP2 loading moves it, to shard on meta everywhere): the
    non-persistent buffers (rotary embeddings' `inv_freq`, in no state dict) are left as `to_empty`
    and the zeroing left them on every rank, and rotary positions vanish (a loader that broadcasts
    only `state_dict()`, as `set_model_state_dict(broadcast_from_rank0=True)` does). Rank 0's alone
    would not show: the reference broadcasts rank 0's buffers before forward, as DDP does."""

    name = "mutant-meta-load-drops-buffers"
    bug = "a model loaded from rank 0 into meta skeletons gets no non-persistent buffers (rotary inv_freq)"
    checks = (LOADED + "test_meta_load",)
    cells = ("test_meta_load[*llama*]", "test_meta_load[*mixtral*]")  # gpt2 has no non-persistent buffer
    needs_zoo = True

    def patch(self) -> None:
        from shardcheck.reference_impl import loading

        original = loading.fill_from_rank0

        def fill(model, values):
            skipped = loading.non_persistent(model)
            kept = {n: b for n, b in model.named_buffers() if n in skipped}
            for name in skipped:  # hidden from the broadcast, and zeroed on rank 0 too
                *path, attr = name.split(".")
                model.get_submodule(".".join(path))._buffers.pop(attr).zero_()
            try:
                original(model, None if values is None else {n: v for n, v in values.items() if n not in skipped})
            finally:
                for name, b in kept.items():
                    *path, attr = name.split(".")
                    model.get_submodule(".".join(path)).register_buffer(attr, b, persistent=False)

        replace(loading, "fill_from_rank0", fill)


class ExportDropsTied(MutantAdapter):
    """The consolidated state dict built from `named_parameters()` (which names a tied weight once) and
    the buffers: the tied output projection's key (`lm_head.weight`) is missing, and a strict load
    into the plain model fails."""

    name = "mutant-export-drops-tied"
    bug = "the exported full state dict drops the key of a tied weight (lm_head.weight)"
    checks = (LOADED + "test_export_from_pretrained",)
    cells = ("test_export_from_pretrained[*gpt2*]", "test_export_from_pretrained[*llama-tied*]")
    needs_zoo = True

    def patch(self) -> None:
        from shardcheck.reference_impl import checkpoint

        original = checkpoint.full_state_dict

        def full_state_dict(model):
            named = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
            return {n: t for n, t in original(model).items() if n in named}

        replace(checkpoint, "full_state_dict", full_state_dict)


class ResumeLosesBuffers(MutantAdapter):
    """A checkpoint that holds the state dict's buffers alone, loaded into storage `to_empty` gave (the
    resume of a model built on meta): the non-persistent buffers (rotary `inv_freq`) are not restored
    and stay zeroed, so training after the load runs without rotary positions."""

    name = "mutant-resume-loses-buffers"
    bug = "a resumed model's non-persistent buffers (rotary inv_freq) left zeroed, not restored"
    checks = (LOADED + "test_resume",)
    cells = ("test_resume[*llama*]", "test_resume[*mixtral*]")  # gpt2 has no non-persistent buffer
    needs_zoo = True

    def patch(self) -> None:
        from shardcheck.reference_impl import checkpoint, loading

        original = checkpoint.load

        def load(path, model, optimizer, scaler=None):
            original(path, model, optimizer, scaler)
            for name in loading.non_persistent(model):
                model.get_buffer(name).detach().zero_()

        replace(checkpoint, "load", load)
