"""Tensor subclasses used by the conformance checks.

``TwoTensor`` is a faithful, self-contained port of
the ``two_tensor.py`` test helper of torch 2.13: a wrapper subclass
that holds two plain tensors ``a`` and ``b`` and runs every aten op on both.

Seed 002 (FSDP2 all-gather extensions) needs, and this supports:

* ``nn.Parameter(TwoTensor(a, b))`` (``requires_grad`` is taken from ``a`` or
  the ``requires_grad`` keyword, as in torch's version);
* every aten op (``matmul``/``linear`` in ``MLP.forward``, Adam ``foreach``
  ops, ``.to(dtype)``, ``copy_``, ``detach``...) via ``__torch_dispatch__``,
  with view/in-place aliasing fixed up by ``return_and_correct_aliasing``;
* ``copy.deepcopy`` (the generic ``Tensor.__deepcopy__`` path through
  ``__tensor_flatten__``/``__reduce_ex__``);
* ``__tensor_flatten__`` / ``__tensor_unflatten__`` (used by FSDP2
  ``fully_shard`` when it builds sharded DTensor parameters and by
  ``torch.compile``).

The FSDP2 all-gather hooks (``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``)
are deliberately NOT defined here: seed 002 monkey-patches them onto the class
for the duration of a test, so an adapter/check must do the same (and remove
them afterwards), e.g. ``TwoTensor.fsdp_pre_all_gather = fn``.

Differences from torch's file: the ``mark_subclass_constructor_exportable_experimental``
decorator (``torch.export`` only) is dropped, and ``__torch_dispatch__`` maps the arguments and
outputs aten ops have (tensors, scalars, flat lists) without pytree, falling back to pytree for
anything else (faster training, docs/speed.md; tests/conformance/test_subclasses.py compares it with torch's
code op by op); behaviour otherwise identical.
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import return_and_correct_aliasing

__all__ = ["TwoTensor", "TwoTensorMode"]


class TwoTensor(torch.Tensor):
    """A tensor subclass holding two same-metadata tensors ``a`` and ``b``."""

    @staticmethod
    def __new__(cls, a, b, outer_size=None, outer_stride=None, *, requires_grad=None):
        if outer_size is None:
            outer_size = a.size()
        if outer_stride is None:
            outer_stride = a.stride()
        if not (
            a.device == b.device
            and a.layout == b.layout
            and a.requires_grad == b.requires_grad
            and a.dtype == b.dtype
        ):
            raise AssertionError(
                "Expected a and b to have same device, layout, requires_grad, and dtype"
            )
        if a.shape != b.shape:
            raise AssertionError(f"Expected a.shape == b.shape, got {a.shape} != {b.shape}")
        if a.stride() != b.stride():
            raise AssertionError(
                f"Expected a.stride() == b.stride(), got {a.stride()} != {b.stride()}"
            )
        if a.storage_offset() != b.storage_offset():
            raise AssertionError(
                "Expected a.storage_offset() == b.storage_offset(), "
                f"got {a.storage_offset()} != {b.storage_offset()}"
            )
        # The outer shape/stride is that of ``a`` (not of cat(a, b)).
        return torch.Tensor._make_wrapper_subclass(
            cls,
            outer_size,
            strides=outer_stride,
            storage_offset=a.storage_offset(),
            device=a.device,
            layout=a.layout,
            requires_grad=requires_grad or a.requires_grad,
            dtype=a.dtype,
        )

    @torch._disable_dynamo
    def __init__(self, a, b, outer_size=None, outer_stride=None, *, requires_grad=None):
        self.a = a
        self.b = b

    def __repr__(self):
        return f"TwoTensor({self.a!r}, {self.b!r})"

    def __tensor_flatten__(self):
        return ["a", "b"], None

    @staticmethod
    def __tensor_unflatten__(inner_tensors, meta, outer_size, outer_stride):
        if meta is not None:
            raise AssertionError("Expected meta to be None")
        a, b = inner_tensors["a"], inner_tensors["b"]
        if type(a) is torch.Tensor:
            if outer_size is None:
                raise AssertionError("Expected outer_size to not be None")
            if outer_stride is None:
                raise AssertionError("Expected outer_stride to not be None")
        return TwoTensor(a, b, outer_size, outer_stride)

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs):
        if kwargs is None:
            kwargs = {}
        args_a, args_b = _parts(args)
        kwargs_a, kwargs_b = _parts(kwargs)

        out_a = func(*args_a, **kwargs_a)
        out_b = func(*args_b, **kwargs_b)
        # For aten ops that return non-tensors, assume both inner tensors
        # return the same value.
        out = _zip_outputs(cls, out_a, out_b)
        from torch._higher_order_ops.cond import cond_op

        if func is cond_op:
            return out
        return return_and_correct_aliasing(func, args, kwargs, out)

    def get_elem_a(self):
        return self.a


_CONTAINERS = (list, tuple, dict)


def _flat(x) -> bool:
    """A list or tuple (exactly: not a namedtuple or torch.Size) holding no container."""
    return type(x) in (list, tuple) and not any(isinstance(y, _CONTAINERS) for y in x)


def _simple(x) -> bool:
    """A leaf (tensor, scalar, None, dtype, ...) or a flat list or tuple: what aten ops take."""
    return not isinstance(x, _CONTAINERS) or _flat(x)


def _part(x, name: str):
    """A simple argument with each TwoTensor replaced by its component ``name``."""
    if isinstance(x, TwoTensor):
        return getattr(x, name)
    if type(x) in (list, tuple):
        return type(x)(getattr(y, name) if isinstance(y, TwoTensor) else y for y in x)
    return x


def _parts(tree):
    """``(tree_a, tree_b)``: ``tree`` (the args tuple or the kwargs dict) with every TwoTensor
    replaced by its ``a``, and by its ``b``: torch's two ``pytree.tree_map_only(TwoTensor, ...)``
    calls. Arguments that are all simple are mapped here, in a fraction of pytree's time (which
    dominated the extensions family's training cells); anything else goes through pytree."""
    if type(tree) is dict and all(_simple(v) for v in tree.values()):
        return ({k: _part(v, "a") for k, v in tree.items()},
                {k: _part(v, "b") for k, v in tree.items()})
    if type(tree) is tuple and all(_simple(x) for x in tree):
        return tuple(_part(x, "a") for x in tree), tuple(_part(x, "b") for x in tree)
    return (pytree.tree_map_only(TwoTensor, lambda x: x.a, tree),
            pytree.tree_map_only(TwoTensor, lambda x: x.b, tree))


def _zip_outputs(cls, out_a, out_b):
    """The op's output with ``cls(a, b)`` for each pair of tensors and ``out_a``'s value for each
    non-tensor: torch's ``tree_flatten``/``tree_unflatten``, without pytree for a tensor or a flat
    list or tuple."""
    if isinstance(out_a, torch.Tensor):
        return cls(out_a, out_b)
    if _flat(out_a):
        if len(out_a) != len(out_b):
            raise ValueError(f"the op returned {len(out_a)} values for a and {len(out_b)} for b")
        return type(out_a)(cls(a, b) if isinstance(a, torch.Tensor) else a for a, b in zip(out_a, out_b))
    out_a_flat, spec = pytree.tree_flatten(out_a)
    out_b_flat = pytree.tree_leaves(out_b)
    out_flat = [cls(o_a, o_b) if isinstance(o_a, torch.Tensor) else o_a
                for o_a, o_b in zip(out_a_flat, out_b_flat, strict=True)]
    return pytree.tree_unflatten(out_flat, spec)


class TwoTensorMode(torch.utils._python_dispatch.TorchDispatchMode):
    """Dispatch mode that turns every freshly constructed tensor into a TwoTensor."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if torch._subclasses.fake_tensor._is_tensor_constructor(func):
            out = TwoTensor(out, out.clone())
        return out
