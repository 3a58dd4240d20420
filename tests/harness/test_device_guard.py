"""shardcheck/harness/device_guard.py: host tensors mixed with the rank's raise, as on a GPU rank;
what a GPU run allows passes; what the guard cannot place is never blamed."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from shardcheck.harness.device_guard import DeviceGuard, DeviceMismatch

RANK_DEVICE = torch.device("cpu")  # ctx.device on this machine: a torch.device, as the harness gives


def test_a_model_built_on_the_host_meets_rank_inputs():
    with DeviceGuard(), pytest.raises(DeviceMismatch, match=r"linear got .* made at .*test_device_guard.py"):
        nn.Linear(3, 2)(torch.randn(4, 3, device=RANK_DEVICE))


def test_a_host_input_meets_a_model_moved_to_the_rank():
    with DeviceGuard(), pytest.raises(DeviceMismatch, match="embedding"):
        nn.Embedding(5, 2).to(RANK_DEVICE)(torch.arange(3))


def test_what_a_gpu_run_allows_passes():
    with DeviceGuard() as guard:
        model = nn.Linear(3, 2).to(RANK_DEVICE)
        x = torch.randn(4, 3, device=RANK_DEVICE)
        y = model(x) * torch.tensor(2.0)  # a 0-dim host tensor: CUDA takes CPU scalars
        host = y.detach().cpu()
        assert guard.home_of(host) == "host" and guard.home_of(y) == "rank"
        assert host is not y  # a move between homes copies, as on a GPU
        back = torch.zeros_like(host).to(x.device) + y.detach()  # .device of a rank tensor
        host.copy_(y)  # copies cross devices
        torch.zeros(4, 2, device=x.device)[0] = host[0]
        (back.sum() + y.sum()).backward()
        assert guard.home_of(model.weight.grad) == "rank"


def test_cpu_by_name_and_unseen_tensors_are_never_blamed():
    made_before = torch.ones(4, 3)
    with DeviceGuard() as guard:
        x = torch.randn(4, 3, device=RANK_DEVICE)
        by_name = torch.zeros(4, 3, device="cpu")  # a mesh's device type: "cpu" here, "cuda" on a GPU
        assert guard.home_of(by_name) is None
        (x + by_name + made_before).sum()
        host = torch.ones(4, 3)
        (host + by_name).sum()
        assert guard.home_of(host.to(torch.device("cpu"))) is None  # moved to a device made from "cpu"


def test_a_host_tensor_derived_keeps_where_it_was_made():
    with DeviceGuard():
        host = torch.ones(4, 3)  # the line a mismatch names
        line = test_a_host_tensor_derived_keeps_where_it_was_made.__code__.co_firstlineno + 2
        derived = (host * 2).reshape(3, 4).t()
        with pytest.raises(DeviceMismatch, match=f"test_device_guard.py:{line} "):
            derived + torch.ones(4, 3, device=RANK_DEVICE)
