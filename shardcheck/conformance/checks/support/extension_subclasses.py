"""Real tensor subclasses that implement FSDP2's all-gather extensions, for the extensions family.

Each kit builds a small model whose weights are one library's subclass (plain float32 elsewhere),
identically on every rank under the check's seed, and names what its `fsdp_pre_all_gather` puts on
the wire:

* `two_tensor`: torch's test subclass `TwoTensor` (support/subclasses.py) with the seed's 5-argument
  hooks (`GatheredTwoTensor` below): both components, float32, padded to ceil(rows / shards) rows.
  Both components hold the same weight; values are compared through `a`. Needs nothing optional.
* `nf4`: torchao's `NF4Tensor` (QLoRA): two LoRA linears, each a FROZEN NF4-quantized base weight
  (block size 64, scaler block size 4, so that 2 and 4 shards split the quantization blocks evenly)
  plus trainable float32 adapters `a` (rank x in) and `b` (out x rank):
  `y = x @ dequant(W).T + (x @ a.T) @ b.T`. On the wire: the int8 block scalers, the float32
  scaler factors, the uint8 packed 4-bit data (the weight is never gathered in float32).
* `float8`: torchao float8 training (`convert_to_float8_training` with
  `enable_fsdp_float8_all_gather=True`): trainable float32 weights wrapped as
  `WeightWithDynamicFloat8CastTensor`, cast to float8 with one global (amax all-reduced) tensorwise
  scale before the all-gather. On the wire: `float8_e4m3fn` only.

The libraries are optional: `missing(kit)` says why a kit cannot run (the check skips with it).
"""

from __future__ import annotations

import functools
import importlib.util
import math
import types
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from shardcheck.conformance.checks.support.subclasses import TwoTensor

INSTALL = {"torchao": "pip install --no-deps torchao==0.18.0"}


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """`x` with zero rows appended up to `rows` (FSDP2 all-gathers padded shards)."""
    return x if x.shape[0] == rows else torch.cat([x, x.new_zeros(rows - x.shape[0], *x.shape[1:])])


class GatheredTwoTensor(TwoTensor):
    """A TwoTensor whose all-gather sends both components (the seed's hooks, 5-argument form)."""

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return GatheredTwoTensor(inner["a"], inner["b"], outer_size, outer_stride)

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        rows = math.ceil(outer_size[0] / mesh.size())
        return (pad_rows(self.a, rows), pad_rows(self.b, rows)), None

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        a, b = outputs
        if out is not None:  # a later all-gather refills the unsharded tensor of the first one
            if out.a.untyped_storage().data_ptr() != a.untyped_storage().data_ptr():
                out.a.copy_(a)
                out.b.copy_(b)
            return None
        return GatheredTwoTensor(a, b).to(param_dtype), (a, b)


def _two_tensor_model() -> nn.Module:
    model = nn.Sequential(nn.Linear(8, 16, bias=False), nn.ReLU(), nn.Linear(16, 8, bias=False))
    for layer in (model[0], model[2]):
        w = layer.weight.detach()
        layer.weight = nn.Parameter(GatheredTwoTensor(w, w.clone()))
    return model


class LoRALinear(nn.Module):
    """A frozen NF4 base weight (out x in) plus trainable low-rank adapters a (r x in), b (out x r)."""

    def __init__(self, dim: int, rank: int = 4) -> None:
        super().__init__()
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

        base = torch.randn(dim, dim) / dim ** 0.5
        self.weight = nn.Parameter(to_nf4(base, block_size=64, scaler_block_size=4), requires_grad=False)
        self.a = nn.Parameter(torch.randn(rank, dim) * 0.1)
        self.b = nn.Parameter(torch.randn(dim, rank) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4

        return linear_nf4(x, self.weight) + (x @ self.a.t()) @ self.b.t()


def _nf4_model() -> nn.Module:
    return nn.Sequential(LoRALinear(64), nn.ReLU(), LoRALinear(64))


def _float8_model() -> nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    return convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))


@dataclass(frozen=True)
class Kit:
    needs: str | None                 # the optional module the kit imports
    build: Callable[[], nn.Module]    # float32 model on the CPU, deterministic under a seed
    inputs: int                       # the model's input width
    wire: frozenset[str]              # dtypes the pre hooks return (what is all-gathered)
    units: tuple[str, ...] = ("0", "2")


KITS = {
    "two_tensor": Kit(None, _two_tensor_model, 8, frozenset({"torch.float32"})),
    "nf4": Kit("torchao", _nf4_model, 64, frozenset({"torch.int8", "torch.float32", "torch.uint8"})),
    "float8": Kit("torchao", _float8_model, 32, frozenset({"torch.float8_e4m3fn"})),
}


def missing(name: str) -> str | None:
    """Why kit `name` cannot run here (its library is not installed), or None."""
    needs = KITS[name].needs
    if needs is not None and importlib.util.find_spec(needs) is None:
        return f"{needs} is not installed ({INSTALL[needs]}): the {name} all-gather extension cells need it"
    return None


def plain(t: torch.Tensor | None) -> torch.Tensor | None:
    """The value of a (possibly subclass) tensor as a plain float32 tensor: a TwoTensor's `a`, an
    NF4Tensor dequantized by `.to`, a float8 training weight unwrapped by any op but a few views."""
    if t is None:
        return None
    t = t.detach().to(torch.float32)
    if isinstance(t, TwoTensor):
        return t.a
    return t if type(t) is torch.Tensor else t + 0


def spy_on_hooks(shards: dict[str, torch.Tensor], seen: dict) -> int:
    """Wrap the all-gather hooks of every local shard that has them, bound to the instance as the
    seed's monkey patch does (nothing global is patched): `seen["pre"]` / `seen["post"]` count the
    calls, `seen["wire"]` collects the dtypes the pre hooks return. `functools.wraps` of the class's
    function keeps its signature, from which the implementation decides how to call it. Returns how
    many shards have hooks."""
    hooked = 0
    for local in shards.values():
        cls = type(local)
        if not (hasattr(cls, "fsdp_pre_all_gather") and hasattr(cls, "fsdp_post_all_gather")):
            continue
        hooked += 1

        @functools.wraps(cls.fsdp_pre_all_gather)
        def counted_pre(self, *args, _pre=cls.fsdp_pre_all_gather, **kwargs):
            inputs, metadata = _pre(self, *args, **kwargs)
            seen["pre"] += 1
            seen["wire"].update(str(t.dtype) for t in inputs)
            return inputs, metadata

        @functools.wraps(cls.fsdp_post_all_gather)
        def counted_post(self, *args, _post=cls.fsdp_post_all_gather, **kwargs):
            seen["post"] += 1
            return _post(self, *args, **kwargs)

        local.fsdp_pre_all_gather = types.MethodType(counted_pre, local)
        local.fsdp_post_all_gather = types.MethodType(counted_post, local)
    return hooked
