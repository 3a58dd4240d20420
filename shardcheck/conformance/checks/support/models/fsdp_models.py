"""Models of torch's FSDP tests (common_fsdp) and the seeds' local models."""

from __future__ import annotations

import re

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn import TransformerDecoderLayer, TransformerEncoderLayer

from shardcheck.conformance.checks.support.models.wrapping import ConformanceModel, RankedModel, ShardUnit, WrapSpec
from shardcheck.harness.context import manual_seed




# --------------------------------------------------------------------------
# common_fsdp.TransformerWithSharedParams
# --------------------------------------------------------------------------


class TransformerWithSharedParams(RankedModel):
    """``nn.Transformer`` (2 enc + 2 dec layers, d_model 16, ffn 8) with the
    token embedding tied to the output projection.

    Port of ``common_fsdp.TransformerWithSharedParams``; ``rank`` only seeds
    ``get_input`` (torch takes a process group and reads ``group.rank()``).
    With ``deterministic=True`` it seeds 0 before building and puts the model
    in ``eval()`` mode (dropout off, BatchNorm uses running stats), exactly as
    torch does.
    """

    D_VOCAB = 23
    D_MODEL = 16
    BS = 2
    # (owner, alias) pairs that must stay the same Parameter object.
    TIED_PARAMS = (("embed_tokens.weight", "output_proj.weight"),)
    # torch's get_ignored_modules()
    IGNORED_MODULE_PATHS = ("transformer",)
    WRAP_SPECS = {
        # FSDPInitMode.RECURSIVE: the root FSDP with
        # ModuleWrapPolicy({TransformerEncoderLayer, TransformerDecoderLayer}).
        "default": WrapSpec(
            unit_classes=(TransformerEncoderLayer, TransformerDecoderLayer),
            note="FSDP1 RECURSIVE: ModuleWrapPolicy({TransformerEncoderLayer, "
            "TransformerDecoderLayer}) plus the root; all units share the kwargs.",
        ),
        # Seed 003 "mixed_strategy": encoder NO_SHARD, decoder FULL_SHARD,
        # root FULL_SHARD, no auto-wrap policy.
        "mixed_strategy": WrapSpec(
            unit_paths=(
                ShardUnit("transformer.encoder", {"sharding_strategy": "NO_SHARD"}),
                ShardUnit("transformer.decoder", {"sharding_strategy": "FULL_SHARD"}),
            ),
            root_options={"sharding_strategy": "FULL_SHARD"},
            note="Seed 003 mixed_strategy: manual FSDP on transformer.encoder "
            "(NO_SHARD) and transformer.decoder (FULL_SHARD), root FULL_SHARD.",
        ),
    }

    EVAL_WHEN_DETERMINISTIC = True

    def build(self, add_bn: bool = True) -> None:
        d_vocab, d_model = self.D_VOCAB, self.D_MODEL
        self.embed_tokens = nn.Embedding(d_vocab, d_model)
        self.transformer = nn.Transformer(
            d_model=d_model,
            num_encoder_layers=2,
            num_decoder_layers=2,
            dim_feedforward=8,
            dropout=0.1,
        )
        self.output_proj = nn.Linear(d_model, d_vocab)
        # Share the embedding and output projection weights.
        self.output_proj.weight = self.embed_tokens.weight
        self.register_buffer("vocab_bias", self.embed_tokens.weight.new_ones((d_model,)))
        self.register_buffer(
            "long_buffer", torch.zeros_like(self.vocab_bias, dtype=torch.long)
        )
        self.bs = self.BS
        self.bn = nn.BatchNorm1d(self.bs) if add_bn else nn.Identity()

    def get_input(self, device):
        self.seed_input()
        src = torch.arange(12, device=device).view(6, self.bs)  # T x B
        tgt = torch.arange(self.bs * 4, device=device).view(4, self.bs)  # T x B
        return (src, tgt)

    def forward(self, src_ids, tgt_ids):
        src = self.embed_tokens(src_ids)
        src = src + self.vocab_bias + self.long_buffer.type_as(src)
        tgt = self.embed_tokens(tgt_ids)
        tgt = self.bn(tgt)
        x = self.transformer(src, tgt)
        return self.output_proj(x)

    def get_loss(self, input, output):
        _, tgt = input
        return F.cross_entropy(output.view(-1, output.size(-1)), tgt.view(-1), reduction="sum")

    def get_ignored_modules(self) -> list[nn.Module]:
        return [self.transformer]


# --------------------------------------------------------------------------
# common_fsdp.NestedWrappedModule / NonUniformReqGradNWM
# --------------------------------------------------------------------------


class NestedWrappedModule(RankedModel):
    """``Linear(8,4) -> [Linear(4,16) -> Linear(16,16)] -> Linear(16,4) -> Linear(4,8)``.

    torch's ``NestedWrappedModule.init(RECURSIVE)`` builds
    ``module = Sequential(Linear(8,4), FSDP(Sequential(FSDP(Linear(4,16)),
    Linear(16,16))), FSDP(Linear(16,4)), Linear(4,8))`` -- it does NOT wrap
    the root itself; seeds 001/003 (and ``_test_fsdp_parity``) then wrap the
    root with the same kwargs. Every unit gets the same kwargs.
    """

    RECURSIVE_UNITS = ("module.1.0", "module.1", "module.2")
    WRAP_SPECS = {
        "default": WrapSpec(
            unit_paths=tuple(ShardUnit(p) for p in RECURSIVE_UNITS),
            note="FSDP1 RECURSIVE: module.1.0, module.1 (nested), module.2; the "
            "root is wrapped by the seed itself with the same kwargs.",
        ),
    }

    def build(self) -> None:
        self.module = nn.Sequential(
            nn.Linear(8, 4),
            nn.Sequential(nn.Linear(4, 16), nn.Linear(16, 16)),
            nn.Linear(16, 4),
            nn.Linear(4, 8),
        )

    def get_input(self, device):
        self.seed_input()
        return (torch.rand(4, 8, device=device),)

    def forward(self, x):
        return self.module(x)


class NonUniformReqGradNWM(NestedWrappedModule):
    """Like ``NestedWrappedModule`` but the last two linears form one unit
    (``module.2 = Sequential(Linear(16,4), Linear(4,8))``) and every parameter
    except ``module.2.1.*`` is frozen, so with 2+ ranks some ranks hold no
    trainable (non-zero sized) shard -- used with ``use_orig_params=True``.

    torch freezes AFTER wrapping. Build with ``freeze=False``, wrap, then call
    ``NonUniformReqGradNWM.set_nonuniform_req_grad(wrapped)`` to reproduce that
    order; the default ``freeze=True`` gives torch's NO_FSDP (reference) model.
    """

    REQ_GRAD_PATTERN = re.compile(r"module\.2.*\.1.*")
    WRAP_SPECS = {
        "default": WrapSpec(
            unit_paths=tuple(ShardUnit(p) for p in NestedWrappedModule.RECURSIVE_UNITS),
            note="FSDP1 RECURSIVE: module.1.0, module.1, module.2 (a Sequential of "
            "the last two linears); root wrapped by the seed; freeze after wrapping.",
        ),
    }

    def build(self, freeze: bool = True) -> None:
        self.module = nn.Sequential(
            nn.Linear(8, 4),
            nn.Sequential(nn.Linear(4, 16), nn.Linear(16, 16)),
            nn.Sequential(nn.Linear(16, 4), nn.Linear(4, 8)),
        )
        if freeze:
            self.set_nonuniform_req_grad(self)

    @classmethod
    def set_nonuniform_req_grad(cls, model: nn.Module, pattern=None) -> None:
        """Freeze every parameter but those matching ``pattern`` (default ``REQ_GRAD_PATTERN``).
        Names are matched with wrapper-internal path components (FSDP1's ``_fsdp_wrapped_module``,
        any component starting with "_") dropped, so it works through any implementation's wrappers."""
        pattern = pattern or cls.REQ_GRAD_PATTERN
        for name, param in model.named_parameters():
            clean = ".".join(c for c in name.split(".") if not c.startswith("_"))
            if not re.match(pattern, clean):
                param.requires_grad_(False)



# --------------------------------------------------------------------------
# Seed-local models
# --------------------------------------------------------------------------


class Net(ConformanceModel):
    """Seed 004 (FSDP1 comm hooks): ``out(relu(net(x)))`` with
    ``net = Sequential(Linear(8,16), ReLU(), Linear(16,8))``, ``out = Linear(8,4)``.

    Always seeds 0 before building (the seed also calls
    ``torch.cuda.manual_seed(0)``, which ``manual_seed`` covers). With
    ``has_wrapping=True`` the seed wraps ``net.2`` and then ``net`` in FSDP
    (same sharding_strategy / mixed_precision as the root), then the root.
    """

    WRAP_SPECS = {
        "has_wrapping": WrapSpec(
            unit_paths=(ShardUnit("net.2"), ShardUnit("net")),
            note="Seed 004 has_wrapping=True: FSDP(net.2) inside FSDP(net), then root; "
            "all with the same sharding_strategy and mixed_precision.",
        ),
        "no_wrapping": WrapSpec(note="Seed 004 has_wrapping=False: root only."),
    }
    IN_FEATURES = 8

    def __init__(self, has_wrapping: bool = False):
        manual_seed(0)
        super().__init__()
        self.has_wrapping = has_wrapping
        self.wrap_variant = "has_wrapping" if has_wrapping else "no_wrapping"
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        self.out = nn.Linear(8, 4)

    def get_input(self, device):
        # Seed 004 draws torch.rand(16, 8) from the current RNG (no reseed).
        return (torch.rand(16, self.IN_FEATURES, device=device),)

    def forward(self, x):
        return self.out(F.relu(self.net(x)))


class TwoLinear(ConformanceModel):
    """Seed 003 ``test_non_root``: ``lin2(lin1(x))`` with two ``Linear(5, 5)``;
    the seed wraps ``lin2`` then the root (clip on the non-root must raise)."""

    WRAP_SPECS = {
        "default": WrapSpec(
            unit_paths=(ShardUnit("lin2"),),
            note="Seed 003 test_non_root: FSDP(lin2), then FSDP(root).",
        ),
    }

    def __init__(self):
        super().__init__()
        self.lin1 = nn.Linear(5, 5)
        self.lin2 = nn.Linear(5, 5)

    def get_input(self, device):
        return (torch.randn((2, 5), device=device),)

    def forward(self, x):
        return self.lin2(self.lin1(x))
