"""GRPO-Guard and Flow-DPPO losses on hand-computed examples.

Each number below is worked out by hand from the formulas in docs/algorithms.md; a wrong
sign, mean or normaliser moves it.
"""

import math

import pytest
import torch

from omnirl.trainer.algorithms.flow_dppo import FlowDPPOLoss, step_kl
from omnirl.trainer.algorithms.flow_grpo import LossInputs
from omnirl.trainer.algorithms.grpo_guard import GRPOGuardLoss
from omnirl.trainer.algorithms.registry import get_loss


def _inputs(new, adv, mean, prox_mean, *, prox=None, behav=None, **kw):
    new = torch.tensor(new, requires_grad=True)
    zeros = torch.zeros_like(new)
    return new, LossInputs(
        log_prob=new,
        prox_log_prob=zeros if prox is None else torch.tensor(prox),
        behav_log_prob=zeros if behav is None else torch.tensor(behav),
        advantages=torch.tensor(adv),
        prev_sample_mean=torch.tensor(mean),
        prox_prev_sample_mean=torch.tensor(prox_mean),
        **kw,
    )


def test_grpo_guard_removes_the_bias_scales_the_ratio_and_reweights_the_step():
    # std_dev_t 0.5, sqrt(-dt) 0.2: scale = 0.1; row 0's means differ by (0.01, 0.03):
    # bias_0 = mean(1e-4, 9e-4) / (2 * 0.1^2) = 5e-4 / 0.02 = 0.025; row 1 has none.
    new, inputs = _inputs(
        [0.1, -0.2],
        [1.0, -1.0],
        [[0.01, 0.03], [0.5, 0.5]],
        [[0.0, 0.0], [0.5, 0.5]],
        std_dev_t=torch.tensor([0.5, 0.5]),
        sqrt_dt=torch.tensor([0.2, 0.2]),
    )
    out = GRPOGuardLoss(GRPOGuardLoss.Config(clip_range=0.5))(inputs)  # nothing clipped
    r0, r1 = math.exp((0.1 + 0.025) * 0.1), math.exp(-0.2 * 0.1)
    assert out.per_sample["ratio"].tolist() == pytest.approx([r0, r1], rel=1e-6)
    assert out.per_sample["ratio_bias"].tolist() == pytest.approx([0.025, 0.0], rel=1e-5)
    # mean(-A * ratio) / mean(sqrt(-dt))^2 = (-r0 + r1) / 2 / 0.04
    assert float(out.loss.detach()) == pytest.approx((-r0 + r1) / 2 / 0.04, rel=1e-6)
    out.loss.backward()
    # d/d new_i = -A_i * ratio_i * scale / (2 * 0.04)
    assert new.grad.tolist() == pytest.approx([-r0 * 0.1 / 0.08, r1 * 0.1 / 0.08], rel=1e-5)


def test_grpo_guard_clips_the_normalised_ratio_and_weights_stale_samples():
    # ratio_0 = exp(0.01) > 1 + 1e-3 with A > 0: clipped (no gradient); behaviour weights
    # exp(prox - behav): exp(log 1.5) = 1.5 and exp(log 3) = 3 truncated to w_max = 2.
    new, inputs = _inputs(
        [0.1, 0.0],
        [1.0, 1.0],
        [[0.0], [0.0]],
        [[0.0], [0.0]],
        prox=[0.0, 0.0],
        behav=[-math.log(1.5), -math.log(3.0)],
        std_dev_t=torch.tensor([1.0, 1.0]),
        sqrt_dt=torch.tensor([0.1, 0.1]),
    )
    out = GRPOGuardLoss(GRPOGuardLoss.Config(clip_range=1e-3))(inputs)
    assert out.per_sample["clipped"].tolist() == [1.0, 0.0]
    assert out.per_sample["importance_weight"].tolist() == pytest.approx([1.5, 2.0], rel=1e-6)
    # row 0: -1 * 1.001 (clipped), weight 1.5; row 1: ratio 1, weight 2; / 0.1^2
    assert float(out.loss.detach()) == pytest.approx(
        (1.5 * -1.001 + 2.0 * -1.0) / 2 / 0.01, rel=1e-6
    )
    out.loss.backward()
    assert new.grad[0] == 0.0 and float(new.grad[1]) == pytest.approx(-2.0 * 0.1 / 2 / 0.01)


def test_grpo_guard_on_policy_ratio_is_exactly_one():
    mean = torch.randn(3, 4, 2, 2)
    _, inputs = _inputs(
        [-1.0, 0.5, 2.0],
        [1.0, -2.0, 0.5],
        mean.tolist(),
        mean.tolist(),
        prox=[-1.0, 0.5, 2.0],
        behav=[-1.0, 0.5, 2.0],
        std_dev_t=torch.full((3,), 0.3),
        sqrt_dt=torch.full((3,), 0.3),
    )
    out = GRPOGuardLoss()(inputs)
    assert out.per_sample["ratio"].tolist() == [1.0, 1.0, 1.0]
    assert float(out.loss.detach()) == pytest.approx(-(1.0 - 2.0 + 0.5) / 3 / 0.09, rel=1e-6)


def test_dppo_step_kl_divides_by_twice_the_step_variance():
    ones, zeros = torch.ones(2, 3), torch.zeros(2, 3)
    assert step_kl(ones, zeros, torch.tensor([0.5, 1.0])).tolist() == [2.0, 0.5]
    assert step_kl(ones, zeros, torch.tensor([0.5, 1.0]), add_kl_coefficient=False).tolist() == [
        0.5,
        0.5,
    ]


def test_dppo_masks_only_high_kl_samples_moving_further_out_and_never_clips():
    # step std 1: kl = mean diff^2 / 2 -> 0.5, 0.5, 0.5, 0.005 against the threshold 0.1.
    # 0: high kl, ratio > 1, A > 0 -> masked;   1: high kl, ratio < 1, A > 0 -> kept
    # 2: high kl, ratio < 1, A < 0 -> masked;   3: low kl, ratio > 1, A = 7 -> kept, unclamped
    new, inputs = _inputs(
        [0.1, -0.1, -0.1, 0.1],
        [1.0, 1.0, -1.0, 7.0],
        [[1.0], [1.0], [1.0], [0.1]],
        [[0.0], [0.0], [0.0], [0.0]],
        step_std=torch.ones(4),
    )
    out = FlowDPPOLoss(FlowDPPOLoss.Config(kl_mask_threshold=0.1))(inputs)
    assert out.per_sample["kl_new_old"].tolist() == pytest.approx([0.5, 0.5, 0.5, 0.005])
    assert out.per_sample["clipped"].tolist() == [1.0, 0.0, 1.0, 0.0]
    e = math.exp(0.1)
    assert float(out.loss.detach()) == pytest.approx((-1.0 / e - 7.0 * e) / 4, rel=1e-6)
    out.loss.backward()
    assert new.grad.tolist() == pytest.approx([0.0, -1.0 / e / 4, 0.0, -7.0 * e / 4], rel=1e-6)


def test_losses_are_registered_and_refuse_missing_inputs():
    assert get_loss("grpo_guard") is GRPOGuardLoss and get_loss("flow_dppo") is FlowDPPOLoss
    assert "clip_range" not in {f for f in FlowDPPOLoss.Config.__dataclass_fields__}
    bare = LossInputs(
        log_prob=torch.zeros(2),
        prox_log_prob=torch.zeros(2),
        behav_log_prob=torch.zeros(2),
        advantages=torch.zeros(2),
    )
    with pytest.raises(ValueError, match="prox_prev_sample_mean"):
        FlowDPPOLoss()(bare)
    with pytest.raises(ValueError, match="sqrt_dt"):
        GRPOGuardLoss()(bare)
    with pytest.raises(ValueError, match="kl_mask_threshold"):
        FlowDPPOLoss.Config(kl_mask_threshold=0.0)
