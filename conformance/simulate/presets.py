"""Model presets built on the meta device: shapes only, no memory.

``transformer-1b``: 24 pre-norm blocks of d_model 2048 (fused qkv, 16 heads, MLP of 5461 -- an odd
width, so no world size divides it), a 32000-token embedding and an untied output head: about
1.07e9 parameters.  ``tiny``: the same architecture with every dimension small and odd.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class Preset:
    layers: int
    d_model: int
    heads: int
    ffn: int
    vocab: int
    seq: int = 8
    batch: int = 1


PRESETS = {
    "tiny": Preset(layers=2, d_model=24, heads=2, ffn=37, vocab=101),
    "transformer-1b": Preset(layers=24, d_model=2048, heads=16, ffn=5461, vocab=32000),
}


class Block(nn.Module):
    def __init__(self, p: Preset):
        super().__init__()
        self.heads = p.heads
        self.norm1, self.norm2 = nn.LayerNorm(p.d_model), nn.LayerNorm(p.d_model)
        self.qkv = nn.Linear(p.d_model, 3 * p.d_model)
        self.proj = nn.Linear(p.d_model, p.d_model)
        self.up, self.down = nn.Linear(p.d_model, p.ffn), nn.Linear(p.ffn, p.d_model)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Transformer(nn.Module):
    def __init__(self, p: Preset):
        super().__init__()
        self.preset = p
        self.embed = nn.Embedding(p.vocab, p.d_model)
        self.blocks = nn.ModuleList(Block(p) for _ in range(p.layers))
        self.norm = nn.LayerNorm(p.d_model)
        self.head = nn.Linear(p.d_model, p.vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def example_input(self, device) -> torch.Tensor:
        return torch.zeros(self.preset.batch, self.preset.seq, dtype=torch.long, device=device)


def build(name: str, device="meta") -> Transformer:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose from {', '.join(PRESETS)}")
    with torch.device(device):
        return Transformer(PRESETS[name])
