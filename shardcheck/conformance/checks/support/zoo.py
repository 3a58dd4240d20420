"""Real architectures, as users train them: transformers' own modules from tiny configs (nothing is
downloaded), each wrapped per decoder layer as the recipes wrap them (family `models`).

Every architecture is a `Workload` (checks/support/workloads.py): `build()` makes the model from its
config in float32 on the CPU (the check seeds and moves it), `loss_fn` is the model's own loss
(transformers' `labels=`: the causal-LM mean over this micro-batch's tokens, plus the router's
auxiliary loss for a mixture of experts; a vision model's cross-entropy over its images), `batches`
draw each rank's token ids (or images and labels), `units` are the decoder layers (a vision model's stages).

| name | what it brings |
|---|---|
| llama | RMSNorm, rotary embeddings (a non-persistent `inv_freq` buffer), grouped-query attention (4 query heads, 2 key/value heads: k_proj and v_proj half the rows of q_proj), untied output projection |
| llama-tied | the same with the input embedding tied to the output projection (`tie_word_embeddings`) |
| gpt2 | GPT-2: transformers' Conv1D (weights stored transposed), learned positions, tied embeddings |
| mixtral | a mixture of experts: 4 experts, 2 per token, the router's auxiliary loss in the loss |
| resnet | a vision model: convolutions and BatchNorm (running statistics: persistent buffers, each rank's own batch normalised by its own statistics), 16 x 16 images in 5 classes, its two stages the units |

The extra `shardcheck[models]` installs transformers; without it these cells skip, saying so.
"""

from __future__ import annotations

import importlib.util
import tempfile
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn as nn

from shardcheck.conformance.checks.support.workloads import Workload

MISSING = "transformers is not installed (pip install 'shardcheck[models]'): the models family needs it"
VOCAB, SEQ, BATCH = 128, 8, 2
IMAGE, CLASSES = 16, 5
_COMMON = {"vocab_size": VOCAB, "max_position_embeddings": 64}
_DECODER = {**_COMMON, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "attention_dropout": 0.0}


def available() -> bool:
    return importlib.util.find_spec("transformers") is not None


# The modules that define the zoo's model classes (tests/conformance/test_models.py holds them to
# ARCHS): each rank process imported them at its first zoo model, about 1.1 CPU-s a process; marked
# on every zoo cell, the session's parent imports them once before its ranks fork (harness `rank_preload`).
MODULES = tuple(f"transformers.models.{name}.modeling_{name}" for name in ("gpt2", "llama", "mixtral", "resnet"))
PRELOAD = [pytest.mark.rank_preload(*MODULES)] if available() else []


def preloaded(test):
    """`test` marked with PRELOAD (a check that builds a zoo model without a zoo parameter)."""
    for mark in PRELOAD:
        test = mark(test)
    return test


@dataclass(frozen=True)
class Arch:
    """One architecture: transformers' model class and config class (by name), the config, and the
    path of its list of decoder layers."""

    name: str
    model_class: str
    config_class: str
    config: dict = field(hash=False)
    layers: str
    num_layers: int = 2
    inputs: str = "tokens"  # or "images": pixel values and class labels (a vision model)

    def config_object(self):
        import transformers

        config = getattr(transformers, self.config_class)(**self.config)
        config._attn_implementation = "eager"  # the same kernels on every engine and the reference
        return config

    def build(self) -> nn.Module:
        import transformers

        return getattr(transformers, self.model_class)(self.config_object())

    def save(self, model: nn.Module, folder) -> None:
        """`model`'s files as `save_pretrained` writes them (config.json, model.safetensors without the
        duplicates of tied weights), written by whichever rank calls it: `save_pretrained` itself
        writes on rank 0 alone once torch.distributed is initialised, and each rank loads from its
        own folder here."""
        from safetensors.torch import save_model

        model.config.save_pretrained(folder)
        save_model(model, f"{folder}/model.safetensors", metadata={"format": "pt"})

    @staticmethod
    def export(model: nn.Module, folder, state_dict: dict) -> None:
        """`model.save_pretrained(folder, state_dict=state_dict)`, as users export a sharded model's
        consolidated state dict (Accelerate's docs: `get_state_dict`, then `save_pretrained`); once
        torch.distributed is initialised it writes on rank 0 alone."""
        import transformers

        transformers.utils.logging.disable_progress_bar()
        model.save_pretrained(folder, state_dict=state_dict)

    def pretrained(self, folder, dtype: torch.dtype | None = None, loading_info: bool = False):
        """The model in `folder` loaded as fine-tuning recipes load it, `from_pretrained(folder,
        dtype=...)`; with `loading_info`, (model, transformers' loading info: missing, unexpected and
        mismatched keys)."""
        import transformers

        transformers.utils.logging.disable_progress_bar()  # a bar's monitor thread would outlive the cell
        kwargs = {"dtype": dtype} if dtype is not None else {}
        out = getattr(transformers, self.model_class).from_pretrained(folder, output_loading_info=loading_info, **kwargs)
        model = out[0] if loading_info else out
        model.config._attn_implementation = "eager"
        return out

    def loaded_in(self, dtype: torch.dtype) -> nn.Module:
        """The model built in float32, saved as `save_pretrained` writes it and loaded back as
        fine-tuning recipes load it, `from_pretrained(..., dtype=dtype)`."""
        with tempfile.TemporaryDirectory(prefix="shardcheck-zoo-") as folder:
            self.save(self.build(), folder)
            return self.pretrained(folder, dtype)

    @property
    def units(self) -> tuple[str, ...]:
        return tuple(f"{self.layers}.{i}" for i in range(self.num_layers))

    def workload(self) -> Workload:
        if self.inputs == "images":
            return Workload(self.build, classification_loss, image_batches, self.units)
        return Workload(self.build, causal_lm_loss, token_batches, self.units)


def causal_lm_loss(model, batch) -> torch.Tensor:
    """The model's own loss: next-token cross-entropy over this micro-batch's tokens (and, for a
    mixture of experts built with `output_router_logits`, the router's auxiliary loss)."""
    ids, labels = batch
    return model(input_ids=ids, labels=labels).loss


def token_batches(ctx, steps: int, poison=None) -> list:
    """Each rank's (input ids, labels) for each step, different per rank and step."""
    assert not poison, "the zoo's models have no poison input"
    out = []
    for step in range(steps):
        with ctx.seeded(1000 * step + ctx.rank):
            ids = torch.randint(0, VOCAB, (BATCH, SEQ), device=ctx.device)
        out.append((ids, ids.clone()))
    return out


def classification_loss(model, batch) -> torch.Tensor:
    """The model's own loss for images: cross-entropy of its logits against the labels (`labels=`)."""
    pixels, labels = batch
    return model(pixel_values=pixels, labels=labels).loss


def image_batches(ctx, steps: int, poison=None) -> list:
    """Each rank's (pixel values, labels) for each step: BATCH images of 3 x IMAGE x IMAGE, CLASSES labels."""
    assert not poison, "the zoo's models have no poison input"
    out = []
    for step in range(steps):
        with ctx.seeded(1000 * step + ctx.rank):
            pixels = torch.randn(BATCH, 3, IMAGE, IMAGE, device=ctx.device)
            labels = torch.randint(0, CLASSES, (BATCH,), device=ctx.device)
        out.append((pixels, labels))
    return out


ARCHS = {arch.name: arch for arch in (
    Arch("llama", "LlamaForCausalLM", "LlamaConfig", {**_DECODER, "tie_word_embeddings": False}, "model.layers"),
    Arch("llama-tied", "LlamaForCausalLM", "LlamaConfig", {**_DECODER, "tie_word_embeddings": True}, "model.layers"),
    Arch("gpt2", "GPT2LMHeadModel", "GPT2Config",
         {"vocab_size": VOCAB, "n_positions": 64, "n_embd": 32, "n_layer": 2, "n_head": 4, "resid_pdrop": 0.0,
          "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": 0, "eos_token_id": 0}, "transformer.h"),
    Arch("mixtral", "MixtralForCausalLM", "MixtralConfig",
         {**_DECODER, "num_local_experts": 4, "num_experts_per_tok": 2, "output_router_logits": True,
          "router_aux_loss_coef": 0.02}, "model.layers"),
    Arch("resnet", "ResNetForImageClassification", "ResNetConfig",
         {"num_channels": 3, "embedding_size": 8, "hidden_sizes": [8, 16], "depths": [1, 1], "layer_type": "basic",
          "num_labels": CLASSES}, "resnet.encoder.stages", inputs="images"),
)}
WORKLOADS = {name: arch.workload() for name, arch in ARCHS.items()}
