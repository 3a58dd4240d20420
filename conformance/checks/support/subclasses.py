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
decorator (``torch.export`` only) is dropped; behaviour otherwise identical.
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
        args_a = pytree.tree_map_only(TwoTensor, lambda x: x.a, args)
        args_b = pytree.tree_map_only(TwoTensor, lambda x: x.b, args)
        kwargs_a = pytree.tree_map_only(TwoTensor, lambda x: x.a, kwargs)
        kwargs_b = pytree.tree_map_only(TwoTensor, lambda x: x.b, kwargs)

        out_a = func(*args_a, **kwargs_a)
        out_b = func(*args_b, **kwargs_b)
        out_a_flat, spec = pytree.tree_flatten(out_a)
        out_b_flat = pytree.tree_leaves(out_b)
        # For aten ops that return non-tensors, assume both inner tensors
        # return the same value.
        out_flat = [
            cls(o_a, o_b) if isinstance(o_a, torch.Tensor) else o_a
            for o_a, o_b in zip(out_a_flat, out_b_flat, strict=True)
        ]
        out = pytree.tree_unflatten(out_flat, spec)
        from torch._higher_order_ops.cond import cond_op

        if func is cond_op:
            return out
        return return_and_correct_aliasing(func, args, kwargs, out)

    def get_elem_a(self):
        return self.a


class TwoTensorMode(torch.utils._python_dispatch.TorchDispatchMode):
    """Dispatch mode that turns every freshly constructed tensor into a TwoTensor."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if torch._subclasses.fake_tensor._is_tensor_constructor(func):
            out = TwoTensor(out, out.clone())
        return out
