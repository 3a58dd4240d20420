"""Mutants of the mixed-precision contract where real models cross it (family mixed_precision): a
policy per unit, and floating buffers under buffer_dtype (shardcheck/reference_impl/sharding.py).

Each names `cells`: globs over the cells of its checks that must fail; every other cell of them
must pass (tests/conformance/test_mutants.py::test_mutant_kills_exactly_its_cells).
"""

from __future__ import annotations

import importlib

import torch
from torch.utils._pytree import tree_map

from shardcheck.conformance.mutants.base import MutantAdapter, replace

PER_UNIT = "test_mixed_precision.py::test_per_unit_policies"
BUFFERS = "test_mixed_precision.py::test_buffer_dtype"


def _sharding():
    return importlib.import_module("shardcheck.reference_impl.sharding")


class CastDetachesOnDtypeChange(MutantAdapter):
    """pytorch#90921: a unit's input that requires a gradient is cast outside autograd, but only
    when the cast changes its dtype. Under one policy for every unit an activation arrives in the
    compute dtype already (nothing is cast), so only per-unit policies cut the gradient."""

    name = "mutant-mp-cast-detaches-on-change"
    bug = "a grad-requiring input cast outside autograd when its dtype changes (pytorch#90921)"
    checks = (PER_UNIT, BUFFERS)
    cells = ("test_per_unit_policies[*]", "test_buffer_dtype[*-own_dtype]")

    def patch(self) -> None:
        def cast(tree, dtype):
            if dtype is None:
                return tree

            def one(x):
                if not (torch.is_tensor(x) and x.is_floating_point()):
                    return x
                return x.detach().to(dtype) if x.dtype != dtype and x.requires_grad else x.to(dtype)
            return tree_map(one, tree)

        replace(_sharding(), "cast_floating", cast)


class BufferDtypeIgnored(MutantAdapter):
    """pytorch#143900: the policy's buffer_dtype is ignored, buffers stay as built."""

    name = "mutant-mp-buffer-dtype-ignored"
    bug = "MixedPrecision.buffer_dtype ignored: buffers keep their dtype (pytorch#143900)"
    checks = (BUFFERS,)
    cells = ("test_buffer_dtype[*-buffer_dtype]",)

    def patch(self) -> None:
        replace(_sharding(), "cast_buffers", lambda module, mp: None)


class BuffersFollowParamDtype(MutantAdapter):
    """Without a buffer_dtype, floating buffers are cast to the policy's param_dtype anyway (as
    `model.to(param_dtype)` does), where they should stay as built."""

    name = "mutant-mp-buffers-follow-param-dtype"
    bug = "buffers cast to param_dtype when the policy sets no buffer_dtype"
    checks = (BUFFERS,)
    cells = ("test_buffer_dtype[*-own_dtype]",)

    def patch(self) -> None:
        sharding = _sharding()
        original = sharding.cast_buffers

        def cast(module, mp):
            if mp is not None and mp.buffer_dtype is None and mp.param_dtype is not None:
                mp = type(mp)(mp.param_dtype, mp.reduce_dtype, mp.param_dtype, mp.keep_low_precision_grads)
            original(module, mp)

        replace(sharding, "cast_buffers", cast)
