"""Models of torch's DTensor/FSDP2 tests: MLP, MLPStack, the small Transformer."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardcheck.conformance.checks.support.models.wrapping import ShardUnit, TPStyle, WrapSpec


# --------------------------------------------------------------------------
# common_fsdp.MLP / MLPStack
# --------------------------------------------------------------------------


class MLP(nn.Module):
    """``relu(out_proj(relu(in_proj(x)))) [+ buffer]`` (common_fsdp.MLP)."""

    def __init__(
        self,
        dim: int,
        device: torch.device | str | None = None,
        *,
        bias: bool = True,
        with_buffer: bool = False,
        dim_multiplier: int = 4,
    ):
        super().__init__()
        self.in_proj = nn.Linear(dim, dim_multiplier * dim, device=device, bias=bias)
        self.out_proj = nn.Linear(dim_multiplier * dim, dim, device=device, bias=bias)
        if with_buffer:
            self.register_buffer("buffer", torch.randn((dim,), device=device))
        else:
            self.buffer = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = F.relu(self.in_proj(x))
        z = F.relu(self.out_proj(z))
        if self.buffer is not None:
            z = z + self.buffer
        return z

    def reset_parameters(self):
        if self.buffer is not None:
            nn.init.normal_(self.buffer)


class MLPStack(nn.Sequential):
    """``Sequential(MLP(d, x3), MLP(d), MLP(d, x3)[, LayerNorm(d, bias=False)])``.

    torch's ``MLPStack.parallelize(tp_mesh, dp_mesh, use_activation_checkpointing,
    **fsdp_kwargs)`` is adapter logic and is not ported. It does:

    1. ``parallelize_module(self, tp_mesh, plan)`` with ``plan = TP_PLAN``
       (``tp_plan()`` below): ``i.in_proj`` ColwiseParallel and ``i.out_proj``
       RowwiseParallel, all with ``use_local_output=False`` (keeps DTensor
       activations, needed for the uneven x3 dims) except the last
       ``2.out_proj``, which is ``RowwiseParallel(output_layouts=Shard(1))``
       with sequence parallel (plain ``RowwiseParallel()`` otherwise); with
       sequence parallel the LayerNorm "3" gets ``SequenceParallel(sequence_dim=1)``;
    2. for every child except the LayerNorm: optional ``checkpoint(module)``
       then ``fully_shard(module, mesh=dp_mesh, **fsdp_kwargs)``;
    3. ``fully_shard(self, mesh=dp_mesh, **fsdp_kwargs)``.
    """

    WRAP_SPECS = {
        "default": WrapSpec(
            unit_paths=(ShardUnit("0"), ShardUnit("1"), ShardUnit("2")),
            note="FSDP2 on the dp mesh after TP on the tp mesh: each MLP, then "
            "the root (the LayerNorm stays in the root's group).",
        ),
    }

    def __init__(self, mlp_dim: int, *, with_seq_parallel: bool = False):
        modules: list[nn.Module] = [
            MLP(mlp_dim, dim_multiplier=3),  # multiplier 3 exercises uneven sharding
            MLP(mlp_dim),
            MLP(mlp_dim, dim_multiplier=3),
        ]
        if with_seq_parallel:
            modules.append(nn.LayerNorm(mlp_dim, bias=False))
        super().__init__(*modules)
        self.with_seq_parallel = with_seq_parallel

    def tp_plan(self) -> dict[str, TPStyle]:
        plan = {
            "0.in_proj": TPStyle("colwise", use_local_output=False),
            "0.out_proj": TPStyle("rowwise", use_local_output=False),
            "1.in_proj": TPStyle("colwise", use_local_output=False),
            "1.out_proj": TPStyle("rowwise", use_local_output=False),
            "2.in_proj": TPStyle("colwise", use_local_output=False),
            "2.out_proj": TPStyle("rowwise", output_shard_dim=1)
            if self.with_seq_parallel
            else TPStyle("rowwise"),
        }
        if self.with_seq_parallel:
            plan["3"] = TPStyle("sequence", sequence_dim=1)
        return plan


# --------------------------------------------------------------------------
# common_dtensor.ModelArgs / Transformer
# --------------------------------------------------------------------------


@dataclass
class ModelArgs:
    n_layers: int = 2
    vocab_size: int = 8
    max_seq_len: int = 16
    dim: int = 16
    n_heads: int = 4
    dropout_p: float = 0.1
    use_attn_mask: bool = True
    weight_tying: bool = True
    checkpoint_activations: bool = False
    num_experts: int = 0


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        if args.dim % args.n_heads != 0:
            raise AssertionError(f"dim {args.dim} not divisible by n_heads {args.n_heads}")
        self.head_dim = args.dim // args.n_heads
        self.n_heads = args.n_heads
        self.dropout_p = args.dropout_p
        self.resid_dropout = nn.Dropout(args.dropout_p)
        self.use_attn_mask = args.use_attn_mask
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, args.dim, bias=False)
        self.wv = nn.Linear(args.dim, args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)

    def forward(self, x):
        bsz, seq_len, _ = x.size()
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        # -> (bsz, n_heads, seq_len, head_dim)
        q = q.view(bsz, seq_len, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(bsz, seq_len, self.n_heads, self.head_dim).transpose(1, 2)
        v = v.view(bsz, seq_len, self.n_heads, self.head_dim).transpose(1, 2)
        output = F.scaled_dot_product_attention(
            q, k, v, None, self.dropout_p if self.training else 0, self.use_attn_mask
        )
        output = output.transpose(1, 2).reshape(bsz, seq_len, -1)
        return self.resid_dropout(self.wo(output))


class FeedForward(nn.Module):
    def __init__(self, dim, hidden_dim, dropout_p):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim)
        self.gelu = nn.GELU()
        self.w2 = nn.Linear(hidden_dim, dim)
        self.resid_dropout = nn.Dropout(dropout_p)

    def forward(self, x):
        return self.resid_dropout(self.w2(self.gelu(self.w1(x))))


class Experts(nn.Module):
    """Dense mixture of experts (all experts on every token), ``num_experts > 0``."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int):
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.reset_parameters()
        self.gelu = nn.GELU()

    def reset_parameters(self):
        nn.init.normal_(self.w1, std=0.02)
        nn.init.normal_(self.w2, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w1, w2 = self.w1, self.w2
        if hasattr(w1, "to_local"):  # DTensor weights sharded by EP/TP
            w1, w2 = w1.to_local(), w2.to_local()
        x_exp = x.unsqueeze(0).expand(w1.shape[0], -1, -1)
        h = self.gelu(torch.bmm(x_exp, w1.transpose(-2, -1)))
        return torch.bmm(h, w2.transpose(-2, -1)).sum(dim=0)


class ExpertLayer(nn.Module):
    def __init__(self, num_experts: int, dim: int, hidden_dim: int):
        super().__init__()
        self.num_experts = num_experts
        self.experts = Experts(dim=dim, hidden_dim=hidden_dim, num_experts=num_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, slen, dim = x.shape
        out = self.experts(x.view(-1, dim)) / self.num_experts
        return out.view(bs, slen, dim)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = nn.LayerNorm(args.dim)
        self.attention = Attention(args)
        self.ffn_norm = nn.LayerNorm(args.dim)
        self.has_experts = args.num_experts > 0
        if self.has_experts:
            self.expert_layer = ExpertLayer(args.num_experts, dim=args.dim, hidden_dim=4 * args.dim)
        else:
            self.feed_forward = FeedForward(args.dim, hidden_dim=4 * args.dim, dropout_p=args.dropout_p)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        if self.has_experts:
            return h + self.expert_layer(self.ffn_norm(h))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Toy nanoGPT-like transformer (common_dtensor.Transformer).

    ``output.weight`` is tied to ``tok_embeddings.weight`` when
    ``args.weight_tying``. Seed 000 builds it after ``torch.manual_seed(42)``
    with ``ModelArgs(dropout_p=0.0)`` and feeds
    ``torch.randint(0, vocab_size, (3, 16))``. torch's static
    ``Transformer.parallelize(module, tp_mesh, use_seq_parallel, ...)`` (TP
    plans for embeddings / attention / FFN / output) is adapter logic and is
    not ported.
    """

    TIED_PARAMS = (("tok_embeddings.weight", "output.weight"),)
    WRAP_SPECS = {
        "default": WrapSpec(
            unit_classes=(TransformerBlock,),
            note="Seed 000: fully_shard(each TransformerBlock) then fully_shard(root).",
        ),
    }

    def __init__(self, args: ModelArgs):
        super().__init__()
        if args.vocab_size is None or args.max_seq_len is None:
            raise AssertionError("vocab_size and max_seq_len must be set")
        self.model_args = args
        self.max_seq_len = args.max_seq_len
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.pos_embeddings = nn.Embedding(args.max_seq_len, args.dim)
        self.dropout = nn.Dropout(args.dropout_p)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = nn.LayerNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.weight_tying:
            self.output.weight = self.tok_embeddings.weight
        self.checkpoint_activations = args.checkpoint_activations

    def forward(self, tokens):
        _bsz, seq_len = tokens.size()
        if seq_len > self.max_seq_len:
            raise AssertionError(f"seq_len {seq_len} > max_seq_len {self.max_seq_len}")
        h = self.tok_embeddings(tokens)
        h = h + self.pos_embeddings(torch.arange(0, seq_len, device=tokens.device))
        h = self.dropout(h)
        for layer in self.layers:
            if self.checkpoint_activations:
                h = torch.utils.checkpoint.checkpoint(layer, h, use_reentrant=False)
            else:
                h = layer(h)
        return self.output(self.norm(h)).float()

