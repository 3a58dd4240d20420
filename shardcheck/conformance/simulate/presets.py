"""Model presets built on the meta device: shapes only, no memory.

``transformer-1b``: 24 pre-norm blocks of d_model 2048 (fused qkv, 16 heads, MLP of 5461 -- an odd
width, so no world size divides it), a 32000-token embedding and an untied output head: about
1.07e9 parameters.  ``tiny``: the same architecture with every dimension small and odd.

The forwards are shape-faithful, not numerically faithful: every parameter is used as in the real
architecture, arithmetic that touches no parameter is left out (see :class:`LlamaBlock`).

``llama3-405b``: Llama-3-405B's dimensions -- 126 blocks of d_model 16384, 128 query heads and 8
key/value heads of head dim 128 (separate wq / wk / wv / wo, no biases), a SwiGLU MLP of 53248
(w1 gate, w3 up, w2 down), RMSNorm weights, a 128256-token embedding and an untied output head:
405,853,388,800 parameters (shapes only: see :class:`LlamaBlock` for what its forward leaves
out).  ``llama3-70b``: Llama-3-70B's -- 80 blocks of d_model 8192, 64 query and 8 key/value heads,
an MLP of 28672, the same vocabulary: 70,553,706,496 parameters.  ``llama-tiny``: the same
architecture small and odd (GQA 4 query / 2 kv heads).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .options import PRESETS, Preset
from shardcheck.errors import UnknownName


class Block(nn.Module):
    def __init__(self, p: Preset):
        super().__init__()
        self.heads = p.heads
        self.norm1, self.norm2 = nn.LayerNorm(p.d_model), nn.LayerNorm(p.d_model)
        self.qkv = nn.Linear(p.d_model, 3 * p.d_model)
        self.proj = nn.Linear(p.d_model, p.d_model)
        self.up, self.down = nn.Linear(p.d_model, p.ffn), nn.Linear(p.ffn, p.d_model)

    def forward(self, x):
        """Shape-faithful (see :class:`LlamaBlock`): the LayerNorms' weight and bias as an affine map
        of the residual stream, attention as scores @ values without softmax and mask."""
        b, s, d = x.shape
        h = torch.addcmul(self.norm1.bias, x, self.norm1.weight)
        q, k, v = self.qkv(h).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        a = (q.transpose(1, 2) @ k.permute(0, 2, 3, 1)) @ v.transpose(1, 2)  # [b, heads, s, head dim]
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.down(F.gelu(self.up(torch.addcmul(self.norm2.bias, x, self.norm2.weight))))


class LlamaBlock(nn.Module):
    """Pre-norm block: grouped-query attention, then a SwiGLU MLP; no biases.

    Shape-faithful, not numerically faithful: every parameter is used as in Llama (the same
    matmuls, the RMSNorm weights as scales of the residual stream, grouped-query attention with
    ``heads / kv_heads`` query heads per key/value head), but arithmetic that touches no parameter
    -- the norms' statistics, the softmax and its causal mask, rotary embeddings -- is left out.
    The simulation has no numerics, and on meta tensors each such op costs a Python meta kernel
    in forward and backward (about half of a 405B step's time)."""

    def __init__(self, p: Preset):
        super().__init__()
        self.heads, self.kv_heads, hd = p.heads, p.kv_heads, p.d_model // p.heads
        self.attention_norm, self.ffn_norm = nn.RMSNorm(p.d_model), nn.RMSNorm(p.d_model)
        self.wq = nn.Linear(p.d_model, p.heads * hd, bias=False)
        self.wk = nn.Linear(p.d_model, p.kv_heads * hd, bias=False)
        self.wv = nn.Linear(p.d_model, p.kv_heads * hd, bias=False)
        self.wo = nn.Linear(p.heads * hd, p.d_model, bias=False)
        self.w1 = nn.Linear(p.d_model, p.ffn, bias=False)
        self.w3 = nn.Linear(p.d_model, p.ffn, bias=False)
        self.w2 = nn.Linear(p.ffn, p.d_model, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        kv, group = self.kv_heads, self.heads // self.kv_heads
        h = x * self.attention_norm.weight
        q = self.wq(h).view(b, s, kv, group, -1).permute(0, 2, 3, 1, 4)  # [b, kv, group, s, hd]
        k = self.wk(h).view(b, s, kv, 1, -1).permute(0, 2, 3, 4, 1)  # [b, kv, 1, hd, s]
        v = self.wv(h).view(b, s, kv, 1, -1).permute(0, 2, 3, 1, 4)  # [b, kv, 1, s, hd]
        a = (q @ k) @ v  # scores, then values: each kv head serves its group of query heads
        x = x + self.wo(a.permute(0, 3, 1, 2, 4).reshape(b, s, -1))
        h = x * self.ffn_norm.weight
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Transformer(nn.Module):
    def __init__(self, p: Preset):
        super().__init__()
        self.preset = p
        self.embed = nn.Embedding(p.vocab, p.d_model)
        block = LlamaBlock if p.arch == "llama" else Block
        self.blocks = nn.ModuleList(block(p) for _ in range(p.layers))
        self.norm = nn.RMSNorm(p.d_model) if p.arch == "llama" else nn.LayerNorm(p.d_model)
        self.head = nn.Linear(p.d_model, p.vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def example_input(self, device) -> torch.Tensor:
        return torch.zeros(self.preset.batch, self.preset.seq, dtype=torch.long, device=device)


class UnknownPreset(UnknownName, ValueError):
    """A --model that names no preset (exit status 4, as an unknown implementation)."""


def build(name: str, device="meta") -> Transformer:
    if name not in PRESETS:
        raise UnknownPreset(f"unknown model preset {name!r}; choose from {', '.join(PRESETS)}")
    with torch.device(device):
        return Transformer(PRESETS[name])


def parameter_bytes(name: str) -> int:
    """The preset's parameters in float32, by arithmetic (built on meta: nothing allocated)."""
    return sum(t.numel() * 4 for t in build(name).parameters())
