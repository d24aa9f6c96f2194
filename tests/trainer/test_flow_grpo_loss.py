"""FlowGRPO / decoupled PPO loss and the KL term on hand-computed numbers."""

import math

import pytest
import torch

from omnirl.trainer.algorithms.flow_grpo import FlowGRPOLoss, LossInputs
from omnirl.trainer.algorithms.kl import flow_grpo_kl

# Four samples, proximal log-prob 0, clip range 0.1 (wide, so the numbers are readable):
#   ratio 1.05, A= 1: inside the clip          -> max(-1.05, -1.05) = -1.05
#   ratio 1.30, A= 1: clipped (optimistic side) -> max(-1.30, -1.10) = -1.10
#   ratio 0.70, A=-2: clipped                   -> max( 1.40,  1.80) =  1.80
#   ratio 1.30, A=-1: unclipped (pessimistic)   -> max( 1.30,  1.10) =  1.30
# mean = 0.95 / 4 = 0.2375 (a sum would give 0.95; min instead of max -0.3125 ...).
RATIOS = [1.05, 1.3, 0.7, 1.3]
ADV = [1.0, 1.0, -2.0, -1.0]
EXPECTED = [-1.05, -1.10, 1.80, 1.30]


def _inputs(behav_shift=(0.0, 0.0, 0.0, 0.0), **kw) -> LossInputs:
    new = torch.tensor([math.log(r) for r in RATIOS], requires_grad=True)
    prox = torch.zeros(4)
    behav = prox - torch.tensor(behav_shift)
    return LossInputs(
        log_prob=new, prox_log_prob=prox, behav_log_prob=behav, advantages=torch.tensor(ADV), **kw
    )


def test_ppo_clip_loss_hand_computed():
    loss_fn = FlowGRPOLoss(FlowGRPOLoss.Config(clip_range=0.1))
    inputs = _inputs()
    out = loss_fn(inputs)
    assert out.loss.item() == pytest.approx(sum(EXPECTED) / 4, abs=1e-6)
    assert out.policy_loss.item() == pytest.approx(0.2375, abs=1e-6)
    assert out.kl.item() == 0.0
    assert out.per_sample["clipped"].tolist() == [0.0, 1.0, 1.0, 1.0]
    assert out.per_sample["ratio"].tolist() == pytest.approx(RATIOS, abs=1e-6)
    out.loss.backward()
    # d/d(new_i) of mean(-A_i * exp(new_i)) = -A_i * ratio_i / 4 where unclipped, 0 where clipped.
    assert inputs.log_prob.grad.tolist() == pytest.approx([-1.05 / 4, 0.0, 0.0, 1.3 / 4], abs=1e-6)


def test_at_ratio_one_gradient_is_minus_advantage():
    loss_fn = FlowGRPOLoss(FlowGRPOLoss.Config(clip_range=1e-4))
    new = torch.zeros(3, requires_grad=True)
    out = loss_fn(
        LossInputs(
            log_prob=new,
            prox_log_prob=new.detach(),
            behav_log_prob=new.detach(),
            advantages=torch.tensor([2.0, -1.0, 0.5]),
        )
    )
    assert out.loss.item() == pytest.approx(-(2.0 - 1.0 + 0.5) / 3, abs=1e-7)
    out.loss.backward()
    assert new.grad.tolist() == pytest.approx([-2 / 3, 1 / 3, -0.5 / 3], abs=1e-7)


def test_decoupled_reduces_to_flow_grpo_when_prox_equals_behav():
    loss_fn = FlowGRPOLoss(FlowGRPOLoss.Config(clip_range=0.1))
    out = loss_fn(_inputs())
    assert out.per_sample["importance_weight"].tolist() == [1.0, 1.0, 1.0, 1.0]
    # flow_grpo's formula, ratio against the recorded log-probs.
    ratio = torch.tensor(RATIOS)
    adv = torch.tensor(ADV)
    ref = torch.mean(torch.maximum(-adv * ratio, -adv * ratio.clamp(0.9, 1.1)))
    assert out.loss.item() == pytest.approx(ref.item(), abs=1e-7)


def test_importance_weight_is_behaviour_to_proximal_truncated_and_detached():
    # w = exp(prox - behav): 1.5, 3 -> truncated to w_max = 2, 0.5 (never raised), 1.
    shift = (math.log(1.5), math.log(3.0), -math.log(2.0), 0.0)
    loss_fn = FlowGRPOLoss(FlowGRPOLoss.Config(clip_range=0.1, w_max=2.0))
    inputs = _inputs(behav_shift=shift)
    out = loss_fn(inputs)
    w = out.per_sample["importance_weight"].tolist()
    assert w == pytest.approx([1.5, 2.0, 0.5, 1.0], abs=1e-6)
    expected = (1.5 * -1.05 + 2.0 * -1.10 + 0.5 * 1.80 + 1.0 * 1.30) / 4
    assert out.loss.item() == pytest.approx(expected, abs=1e-6)
    # the clip is against the proximal policy, not the behaviour policy: same clip mask.
    assert out.per_sample["clipped"].tolist() == [0.0, 1.0, 1.0, 1.0]
    out.loss.backward()
    assert inputs.log_prob.grad.tolist() == pytest.approx(
        [-1.5 * 1.05 / 4, 0.0, 0.0, 1.3 / 4], abs=1e-6
    )


def test_kl_term_hand_computed():
    # mu - mu_ref = [1, 3] and [2, 2]: mean squares 5 and 4; std_dev_t 1 and 2
    # -> 5 / (2 * 1) = 2.5 and 4 / (2 * 4) = 0.5; mean 1.5.
    mu_ref = torch.zeros(2, 1, 1, 2)
    mu = torch.tensor([[[[1.0, 3.0]]], [[[2.0, 2.0]]]], requires_grad=True)
    std = torch.tensor([1.0, 2.0])
    assert flow_grpo_kl(mu, mu_ref, std).tolist() == pytest.approx([2.5, 0.5])
    # std_dev_t given as [B, 1, 1, 1], as flow_grpo passes it.
    assert flow_grpo_kl(mu, mu_ref, std.view(2, 1, 1, 1)).tolist() == pytest.approx([2.5, 0.5])

    loss_fn = FlowGRPOLoss(FlowGRPOLoss.Config(clip_range=0.1, kl_beta=0.1))
    base = _inputs()
    inputs = LossInputs(
        log_prob=base.log_prob,
        prox_log_prob=base.prox_log_prob,
        behav_log_prob=base.behav_log_prob,
        advantages=base.advantages,
        prev_sample_mean=torch.cat([mu, mu]),
        ref_prev_sample_mean=torch.cat([mu_ref, mu_ref]),
        std_dev_t=torch.cat([std, std]),
    )
    out = loss_fn(inputs)
    assert out.kl.item() == pytest.approx(1.5)
    assert out.loss.item() == pytest.approx(0.2375 + 0.1 * 1.5, abs=1e-6)
    out.loss.backward()
    # d k_b / d mu_e = d_e / (2 std_b^2) (mean over 2 elements of d^2), times beta / B = 0.1 / 4;
    # mu[0] appears twice in the batch (samples 0 and 2): [0.5, 1.5] * 0.025 * 2.
    assert mu.grad[0, 0, 0].tolist() == pytest.approx([0.025, 0.075], abs=1e-7)


def test_needs_declares_reference_inputs_only_with_kl():
    assert "ref_prev_sample_mean" not in FlowGRPOLoss(FlowGRPOLoss.Config()).needs()
    with_kl = FlowGRPOLoss(FlowGRPOLoss.Config(kl_beta=0.01)).needs()
    assert {"ref_prev_sample_mean", "prev_sample_mean", "std_dev_t", "log_prob"} <= with_kl


def test_bad_inputs_and_config_are_refused():
    with pytest.raises(ValueError, match="clip_range"):
        FlowGRPOLoss.Config(clip_range=0.0)
    with pytest.raises(ValueError, match="w_max"):
        FlowGRPOLoss.Config(w_max=0.5)
    loss_fn = FlowGRPOLoss(FlowGRPOLoss.Config(kl_beta=0.1))
    with pytest.raises(ValueError, match="kl_beta > 0 needs"):
        loss_fn(_inputs())
    with pytest.raises(ValueError, match="must all be"):
        FlowGRPOLoss()(
            LossInputs(
                log_prob=torch.zeros(3),
                prox_log_prob=torch.zeros(3),
                behav_log_prob=torch.zeros(3),
                advantages=torch.zeros(4),
            )
        )
    with pytest.raises(ValueError, match="std_dev_t > 0"):
        flow_grpo_kl(torch.zeros(2, 3), torch.zeros(2, 3), torch.tensor([1.0, 0.0]))
