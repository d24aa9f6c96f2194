"""HostSteps: per-step tensors gathered on the host as [B, K, *S]."""

from __future__ import annotations

import pytest
import torch

from omnirl.models.device import synchronize
from omnirl.models.host_steps import HostSteps


def test_steps_gather_per_sample_in_step_order(test_device):
    device = torch.device(test_device)
    steps = HostSteps(3, device)
    xs = [torch.randn(4, 2, 5, device=device) for _ in range(3)]
    for k, x in enumerate(xs):
        steps.record("latents", k, x)
        steps.record("log_probs", k, x.sum((1, 2)))
    synchronize(device)
    lat = steps.get("latents")
    assert lat.device.type == "cpu" and lat.shape == (4, 3, 2, 5)
    assert torch.equal(lat, torch.stack([x.cpu() for x in xs], 1))
    assert torch.equal(steps.get("log_probs"), torch.stack([x.sum((1, 2)).cpu() for x in xs], 1))
    assert "latents" in steps and "noise" not in steps


def test_a_copy_does_not_alias_the_recorded_tensor():
    steps = HostSteps(1, torch.device("cpu"))
    x = torch.zeros(2, 3)
    steps.record("x", 0, x)
    x.fill_(1.0)
    assert torch.equal(steps.get("x")[:, 0], torch.zeros(2, 3))


def test_bad_steps_and_shapes_are_refused():
    steps = HostSteps(2, torch.device("cpu"))
    steps.record("x", 0, torch.zeros(2, 3))
    with pytest.raises(IndexError, match="step 2 outside the 2"):
        steps.record("x", 2, torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"x: step 1 is \(2, 4\)"):
        steps.record("x", 1, torch.zeros(2, 4))
    with pytest.raises(ValueError, match="steps must be >= 0"):
        HostSteps(-1, torch.device("cpu"))
