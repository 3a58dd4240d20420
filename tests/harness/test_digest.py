"""shardcheck/harness/digest.py: equal digests mean identical values; no digest where that cannot be promised."""

from fractions import Fraction

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

from shardcheck.harness.digest import SIZE, digest

_tensors = st.builds(
    lambda values, dtype: torch.tensor(values, dtype=dtype),
    st.lists(st.floats(allow_nan=True, width=32), min_size=0, max_size=6),
    st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))


@given(_tensors, _tensors)
def test_tensors_agree_exactly_when_dtype_shape_and_bits_do(a, b):
    same = a.dtype == b.dtype and a.shape == b.shape and bytes(a.view(torch.uint8).numpy()) == bytes(
        b.view(torch.uint8).numpy())
    assert (digest(a) == digest(b)) == same
    assert len(digest(a)) == SIZE


def test_layout_does_not_count_and_signed_zeros_do():
    t = torch.arange(6.0).reshape(2, 3)
    assert digest(t.t()) == digest(t.t().contiguous())
    assert digest(torch.tensor([0.0])) != digest(torch.tensor([-0.0]))
    assert digest(torch.nn.Parameter(t)) == digest(t)


def test_containers_count_by_type_and_order():
    assert digest([1, 2]) != digest((1, 2))
    assert digest({"a": 1, "b": 2}) != digest({"b": 2, "a": 1})
    assert digest((1, "1")) != digest(("1", 1))
    assert digest((True, 1.0, None)) == digest((True, 1.0, None))
    assert digest([torch.float32, torch.device("cpu")]) != digest([torch.float64, torch.device("cpu")])


def test_values_without_a_faithful_form_have_none():
    assert digest(Fraction(1, 3)) is None
    assert digest({"x": [1, np.arange(5000)]}) is None  # numpy's repr abbreviates
    assert digest(torch.ones(2).to_sparse()) is None


def test_digests_need_no_numpy():
    """numpy is not a dependency of shardcheck (nor of torch): a digest made where it cannot be
    imported is the same digest."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['numpy'] = None; import torch; from shardcheck.harness.digest import digest; "
            "print(digest([torch.arange(5.0), torch.ones(2, dtype=torch.bfloat16)]).hex())")
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == digest([torch.arange(5.0), torch.ones(2, dtype=torch.bfloat16)]).hex()
