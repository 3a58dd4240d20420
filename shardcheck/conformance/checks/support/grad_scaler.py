"""Helpers of the sharded grad scaler checks (checks/api/test_grad_scaler.py)."""

from __future__ import annotations

import torch

from shardcheck.conformance.checks.support.tensors import local_part
from shardcheck.conformance.checks.support.models import TransformerWithSharedParams


def zero_params_(model) -> None:
    """The seed's `_zero_model`: every parameter (each rank's shard of it) set to 0."""
    with torch.no_grad():
        for p in model.parameters():
            local_part(p).zero_()


def state_dict_round_trip(model) -> None:
    """The seed's save_model step: clone the state_dict, zero the parameters, load it back."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    zero_params_(model)
    model.load_state_dict(state)


def named_with_grad(m) -> list:
    return [(n, p) for n, p in m.named_parameters() if p.grad is not None]


def without_key_bias(params: dict) -> dict:
    """Drop the key third of every attention `in_proj_bias`. Its gradient is analytically zero (the
    key bias adds q.b_k to every score of a query alike, and softmax ignores that), so it is float
    noise (~1e-9) that any change of reduction order changes; Adam's m / sqrt(v) turns that noise into
    lr-sized steps of arbitrary sign. The seed compares losses only; the rest is compared exactly."""
    d = TransformerWithSharedParams.D_MODEL
    return {n: torch.cat([t[:d], t[2 * d:]]) if n.endswith("in_proj_bias") else t for n, t in params.items()}
