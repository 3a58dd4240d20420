"""Mutants the family models kills (shardcheck/conformance/checks/behaviour/test_models.py), and the
model their runs judge: `tied_tower`, a transformers-free tower whose input embedding is tied to its
output projection, as Llama's `tie_word_embeddings` and GPT-2 tie them (the mutant runs pass it as
the user's own model, `--shardcheck-model`, so they need no transformers)."""

from __future__ import annotations

import torch
import torch.nn as nn

from shardcheck.conformance.mutants.base import MutantAdapter, before_shard, untie_shared

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
