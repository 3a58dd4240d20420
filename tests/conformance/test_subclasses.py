"""TwoTensor (shardcheck/conformance/checks/support/subclasses.py): the tensor subclass that seed 002 shards."""

import copy

import pytest
import torch
import torch.nn as nn

from shardcheck.conformance.checks.support import models as M
from shardcheck.conformance.checks.support.subclasses import TwoTensor, TwoTensorMode

# nn.Transformer (inside TransformerWithSharedParams) warns about nested tensors,
# exactly like torch's original model; it is irrelevant here.
pytestmark = pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")




# --------------------------------------------------------------- TwoTensor


def test_two_tensor_basic_ops():
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    t = TwoTensor(a, b)
    assert isinstance(t, TwoTensor) and t.shape == (3, 4) and t.dtype == torch.float32
    s = t + 1
    assert isinstance(s, TwoTensor)
    assert torch.equal(s.a, a + 1) and torch.equal(s.b, b + 1)
    m = t @ torch.ones(4, 2)
    assert isinstance(m, TwoTensor) and m.shape == (3, 2)
    assert torch.equal(m.a, a @ torch.ones(4, 2)) and torch.equal(m.b, b @ torch.ones(4, 2))
    v = t.view(12)
    assert isinstance(v, TwoTensor) and v.shape == (12,)
    tr = t.t()
    assert tr.shape == (4, 3) and tr.stride() == (1, 4)
    a0, b0 = a.clone(), b.clone()
    r = t.mul_(2)
    assert r is t and t.a is a  # in-place ops mutate the inner tensors
    assert torch.equal(a, 2 * a0) and torch.equal(b, 2 * b0)
    assert "TwoTensor(" in repr(t)
    assert t.get_elem_a() is t.a


def test_two_tensor_validation():
    with pytest.raises(AssertionError):
        TwoTensor(torch.randn(2), torch.randn(3))
    with pytest.raises(AssertionError):
        TwoTensor(torch.randn(2), torch.randn(2, dtype=torch.float64))
    with pytest.raises(AssertionError):
        TwoTensor(torch.randn(2, 2), torch.randn(2, 2).t().contiguous().t())


def test_two_tensor_to_dtype_deepcopy_flatten():
    t = TwoTensor(torch.randn(2, 3), torch.randn(2, 3))
    h = t.to(torch.bfloat16)
    assert isinstance(h, TwoTensor) and h.dtype == torch.bfloat16 and h.a.dtype == torch.bfloat16
    c = copy.deepcopy(t)
    assert isinstance(c, TwoTensor) and c.a is not t.a
    assert torch.equal(c.a, t.a) and torch.equal(c.b, t.b)
    names, meta = t.__tensor_flatten__()
    assert names == ["a", "b"] and meta is None
    r = TwoTensor.__tensor_unflatten__({"a": t.a, "b": t.b}, meta, t.size(), t.stride())
    assert isinstance(r, TwoTensor) and r.a is t.a and r.shape == t.shape
    with pytest.raises(AssertionError):
        TwoTensor.__tensor_unflatten__({"a": t.a, "b": t.b}, "meta", t.size(), t.stride())


def _two_tensor_mlp_stack():
    # exactly seed 002's _init_two_tensor_mlp()
    model = nn.Sequential(*[M.MLP(8, bias=False) for _ in range(3)])
    for mlp in model:
        mlp.in_proj.weight = nn.Parameter(TwoTensor(mlp.in_proj.weight, mlp.in_proj.weight.clone()))
        mlp.out_proj.weight = nn.Parameter(
            TwoTensor(mlp.out_proj.weight, mlp.out_proj.weight.clone())
        )
    return model


def test_two_tensor_parameter_adam_foreach():
    torch.manual_seed(42)
    model = _two_tensor_mlp_stack()
    for p in model.parameters():
        assert isinstance(p, nn.Parameter) and isinstance(p, TwoTensor) and p.requires_grad
    ref = copy.deepcopy(model)
    assert all(isinstance(p, TwoTensor) for p in ref.parameters())
    optim = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
    inp = torch.randn(2, 8)
    before = [p.detach().a.clone() for p in model.parameters()]
    for i in range(3):
        loss = model(inp).sum()
        assert isinstance(loss, TwoTensor)
        loss.backward()
        for p in model.parameters():
            assert isinstance(p.grad, TwoTensor)
            # a and b start equal and see identical ops, so they stay equal
            assert torch.equal(p.grad.a, p.grad.b)
        optim.step()
        optim.zero_grad(set_to_none=(i % 2 == 0))
    for p, b0 in zip(model.parameters(), before):
        assert not torch.equal(p.a, b0)
        assert torch.equal(p.a, p.b)
    # a plain model with the same init trained identically gives the same params
    torch.manual_seed(42)
    plain = nn.Sequential(*[M.MLP(8, bias=False) for _ in range(3)])
    popt = torch.optim.Adam(plain.parameters(), lr=1e-2, foreach=True)
    for i in range(3):
        plain(inp).sum().backward()
        popt.step()
        popt.zero_grad(set_to_none=(i % 2 == 0))
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(p.a, q)


def test_two_tensor_meta_init():
    with torch.device("meta"):
        model = _two_tensor_mlp_stack()
    for p in model.parameters():
        assert p.device.type == "meta" and isinstance(p, TwoTensor)


def test_two_tensor_mode():
    with TwoTensorMode():
        x = torch.ones(2)
    assert isinstance(x, TwoTensor) and torch.equal(x.a, x.b)


class _PytreeTwoTensor(TwoTensor):
    """torch's own ``__torch_dispatch__`` (pytree throughout): the oracle for TwoTensor's."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs):
        import torch.utils._pytree as pytree
        from torch.utils._python_dispatch import return_and_correct_aliasing

        kwargs = kwargs or {}
        args_a = pytree.tree_map_only(TwoTensor, lambda x: x.a, args)
        args_b = pytree.tree_map_only(TwoTensor, lambda x: x.b, args)
        kwargs_a = pytree.tree_map_only(TwoTensor, lambda x: x.a, kwargs)
        kwargs_b = pytree.tree_map_only(TwoTensor, lambda x: x.b, kwargs)
        out_a, out_b = func(*args_a, **kwargs_a), func(*args_b, **kwargs_b)
        out_a_flat, spec = pytree.tree_flatten(out_a)
        out_flat = [cls(o_a, o_b) if isinstance(o_a, torch.Tensor) else o_a
                    for o_a, o_b in zip(out_a_flat, pytree.tree_leaves(out_b), strict=True)]
        return return_and_correct_aliasing(func, args, kwargs, pytree.tree_unflatten(out_flat, spec))


_OPS = {
    "add": lambda x, y: x + y,
    "add_plain": lambda x, y: x + y.a,
    "mul_": lambda x, y: x.mul_(2.0),
    "cat": lambda x, y: torch.cat([x, y, x], dim=1),
    "stack_kw": lambda x, y: torch.stack((x, y), dim=0),
    "split": lambda x, y: x.split([1, 2], dim=0),
    "index_none": lambda x, y: x[None, torch.tensor([2, 0])],
    "max_dim": lambda x, y: x.max(dim=1),
    "sort": lambda x, y: torch.sort(x, dim=0, descending=True),
    "foreach_add": lambda x, y: torch._foreach_add([x, y], [y, x]),
    "foreach_mul_": lambda x, y: torch._foreach_mul_([x, y], 0.5),
    "view_t": lambda x, y: x.view(4, 3).t(),
    "to_bf16": lambda x, y: x.to(torch.bfloat16),
    "copy_": lambda x, y: x.copy_(y),
    "where": lambda x, y: torch.where(x > 0, x, y),
    "sum_item": lambda x, y: (x * y).sum().item(),
    "size": lambda x, y: x.new_zeros(x.size()).shape,
}


@pytest.mark.parametrize("op", sorted(_OPS))
def test_two_tensor_dispatch_matches_torchs(op):
    """Every output of an op (tensors as their a and b, non-tensors, container types, aliasing of
    in-place and view ops) is what torch's pytree-based dispatch gives."""
    results = []
    for cls in (TwoTensor, _PytreeTwoTensor):
        torch.manual_seed(0)
        x = cls(torch.randn(3, 4), torch.randn(3, 4))
        y = cls(torch.randn(3, 4), torch.randn(3, 4))
        out = _OPS[op](x, y)
        results.append((out, x, y))
    (got, gx, gy), (want, wx, wy) = results

    def same(g, w):
        assert type(g) is type(w) or (isinstance(g, TwoTensor) and isinstance(w, TwoTensor)), (g, w)
        if isinstance(g, TwoTensor):
            assert g.shape == w.shape and g.stride() == w.stride() and g.dtype == w.dtype
            assert torch.equal(g.a, w.a) and torch.equal(g.b, w.b)
        elif isinstance(g, torch.Tensor):
            assert torch.equal(g, w)
        elif isinstance(g, (list, tuple)):
            assert len(g) == len(w)
            for gi, wi in zip(g, w):
                same(gi, wi)
        else:
            assert g == w

    same(got, want)
    same((gx, gy), (wx, wy))  # in-place ops changed the same inputs alike
    if op in ("mul_", "copy_"):
        assert got is gx and want is wx
