"""Small models and parity helpers for the reference_impl tests (shapes chosen to shard unevenly)."""
import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import shardcheck.reference_impl as R

S = R.ShardingStrategy
# World sizes 2 and 4 are judged by the conformance matrix, which the README's test command runs on the
# reference too (behaviour and api families: the same features against unsharded data parallelism);
# these unit tests keep the sizes it does not run: one rank, and an odd world with uneven rows.
WS = [1, 3]


class Block(nn.Module):
    def __init__(self, d=6, h=10):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class SharedTransformer(nn.Module):
    """TransformerWithSharedParams-like: embedding tied to the output projection, encoder/decoder."""

    def __init__(self, vocab=11, d=6):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.encoder = nn.Sequential(Block(d), Block(d))
        self.decoder = nn.Sequential(Block(d), Block(d))
        self.out = nn.Linear(d, vocab, bias=False)
        self.out.weight = self.embed.weight  # tied
        self.scale = nn.Parameter(torch.tensor(1.5))  # 0-d parameter
        self.register_buffer("shift", torch.full((d,), 0.1))

    def forward(self, tok):
        x = self.embed(tok) + self.shift
        x = self.decoder(self.encoder(x) * self.scale)
        return self.out(x)


class Nested(nn.Module):
    """NestedWrappedModule-like with a frozen parameter and an unused one (grad stays None)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(5, 7)
        self.mid = nn.Sequential(nn.Linear(7, 9), nn.ReLU(), nn.Sequential(nn.Linear(9, 3), nn.Linear(3, 7)))
        self.head = nn.Linear(7, 2)
        self.unused = nn.Linear(3, 3)
        self.mid[0].weight.requires_grad_(False)

    def forward(self, x):
        return self.head(self.mid(self.inp(x)))


def build(kind, ctx, seed=0):
    """Identical on every rank (also in thread mode, where the RNG is shared)."""
    with ctx.seeded(seed):
        return SharedTransformer() if kind == "shared" else Nested()


def apply_sharding(model, ctx, strategy, mesh=None, **kw):
    """Shard the blocks (or nested parts), then the root. ``strategy == "mixed"``: encoder NO_SHARD,
    decoder FULL_SHARD, root FULL_SHARD (seed 003's mixed_strategy)."""
    group = None if mesh is not None else ctx.group
    kw = dict(mesh=mesh, process_group=group, **kw)
    if isinstance(model, SharedTransformer):
        if strategy == "mixed":
            R.shard(model.encoder, strategy=S.NO_SHARD, **kw)
            R.shard(model.decoder, strategy=S.FULL_SHARD, **kw)
            return R.shard(model, strategy=S.FULL_SHARD, **kw)
        for blk in [*model.encoder, *model.decoder]:
            R.shard(blk, strategy=strategy, **kw)
    else:
        R.shard(model.mid[2], strategy=strategy, **kw)
        R.shard(model.mid, strategy=strategy, **kw)
    return R.shard(model, strategy=strategy, **kw)


def make_input(kind, ctx, step):
    """Different data on every rank (seeded by rank and step)."""
    with ctx.seeded(1000 * step + ctx.rank):
        if kind == "shared":
            return torch.randint(0, 11, (3, 4))
        return torch.randn(4, 5)


def average_grads(model, ctx):
    """What data parallelism must produce: the mean over ranks of the local gradients."""
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=ctx.group)
            p.grad /= ctx.world_size


def assert_grads_match(ref, model, atol=1e-5, rtol=1e-4):
    got = R.full_grads(model)
    for n, p in ref.named_parameters():
        if p.grad is None:
            assert got[n] is None, n
        else:
            assert got[n] is not None, n
            torch.testing.assert_close(got[n].float(), p.grad.float(), atol=atol, rtol=rtol, msg=n)


def assert_params_match(ref, model, atol=1e-5, rtol=1e-4):
    got = R.full_state(model)
    assert list(got) == [n for n, _ in ref.named_parameters()]
    for n, p in ref.named_parameters():
        torch.testing.assert_close(got[n], p.detach(), atol=atol, rtol=rtol, msg=n)


def train_parity(ctx, kind, model, ref, steps=3, atol=1e-5, rtol=1e-4, loss_fn=None):
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    loss_fn = loss_fn or (lambda out: out.float().pow(2).mean())
    for step in range(steps):
        x = make_input(kind, ctx, step)
        loss = loss_fn(model(x))
        loss.backward()
        ref_loss = loss_fn(ref(x))
        ref_loss.backward()
        average_grads(ref, ctx)
        torch.testing.assert_close(loss, ref_loss, atol=atol, rtol=rtol)
        assert_grads_match(ref, model, atol, rtol)
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)
        ref_opt.zero_grad(set_to_none=step % 2 == 0)
        assert_params_match(ref, model, atol, rtol)


def sharded_copy(ref, ctx, strategy, **kw):
    return apply_sharding(copy.deepcopy(ref), ctx, strategy, **kw)
