"""What `shardcheck simulate` can be asked for, without torch (its --help lists them): the model
presets' dimensions (presets.py builds them), the step modes (shard_layouts.py), the implementations whose
shards are also checked parameter by parameter (impls.py's simulators)."""

from __future__ import annotations

from dataclasses import dataclass

STEP_MODES = ("classes", "all", "first", "none")  # on which simulated ranks one training step runs
LAYOUT_CHECKED = ("reference", "torch-fsdp2")  # impls.SIMULATORS, in this order


@dataclass(frozen=True)
class Preset:
    layers: int
    d_model: int
    heads: int
    ffn: int
    vocab: int
    seq: int = 8
    batch: int = 1
    arch: str = "gpt"  # "gpt" (Block) or "llama" (LlamaBlock)
    kv_heads: int = 0  # llama: key/value heads (grouped-query attention)


PRESETS = {
    "tiny": Preset(layers=2, d_model=24, heads=2, ffn=37, vocab=101),
    "transformer-1b": Preset(layers=24, d_model=2048, heads=16, ffn=5461, vocab=32000),
    "llama-tiny": Preset(layers=3, d_model=24, heads=4, ffn=37, vocab=101, arch="llama", kv_heads=2),
    "llama3-70b": Preset(layers=80, d_model=8192, heads=64, ffn=28672, vocab=128256, arch="llama", kv_heads=8),
    "llama3-405b": Preset(layers=126, d_model=16384, heads=128, ffn=53248, vocab=128256, arch="llama", kv_heads=8),
}
