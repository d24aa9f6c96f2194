"""Online Diffusion-DPO: pair choice with ties, the loss on a hand-computed example, and one
step on the tiny SD3 (moves the LoRA; a stale group trains like a fresh one).

Worked example (one pair, 2-element latents), dpo_beta = 1:
target_w = [1, 0], v_theta_w = [2, 0] -> e_w = (1 + 0) / 2 = 0.5;  v_ref_w = [1, 0] -> ref_w = 0
target_l = [0, 1], v_theta_l = [0, 1] -> e_l = 0;                 v_ref_l = [0, 3] -> ref_l = 2
inside = -1/2 * ((0.5 - 0) - (0 - 2)) = -1.25;  loss = -log sigmoid(-1.25) = 1.5197...
"""

import math

import msgspec
import pytest
import torch

from omnirl.models.registry import get_rollout_adapter, get_training_adapter
from omnirl.protocol.messages import PromptSpec, Rewards, SamplingParams
from omnirl.trainer.algorithms.diffusion_dpo import (
    DiffusionDPOLoss,
    DPOLossInputs,
    preference_pair,
)
from omnirl.trainer.algorithms.windows import lease_sampling
from omnirl.trainer.forward_step import ForwardProcessStep
from omnirl.trainer.step import TrainStep

ARCH = "StableDiffusion3Pipeline"
LORA = {"r": 4, "lora_alpha": 4, "init_lora_weights": "gaussian"}


def test_preference_pair_breaks_ties_by_lowest_index():
    assert preference_pair([0.1, 0.9, 0.5]) == (1, 0)
    assert preference_pair([1.0, 0.0, 1.0, 0.0]) == (0, 1)
    assert preference_pair([2.0, 2.0]) is None
    assert preference_pair([3.0]) is None


def _inputs(v_theta_w):
    return DPOLossInputs(
        target_w=torch.tensor([[1.0, 0.0]]),
        target_l=torch.tensor([[0.0, 1.0]]),
        v_theta_w=v_theta_w,
        v_theta_l=torch.tensor([[0.0, 1.0]]),
        v_ref_w=torch.tensor([[1.0, 0.0]]),
        v_ref_l=torch.tensor([[0.0, 3.0]]),
    )


def test_worked_example_and_gradient_sign():
    loss = DiffusionDPOLoss(DiffusionDPOLoss.Config(dpo_beta=1.0))
    v = torch.tensor([[2.0, 0.0]], requires_grad=True)
    out = loss(_inputs(v))
    expected = -math.log(1.0 / (1.0 + math.exp(1.25)))
    assert out.loss.item() == pytest.approx(expected, abs=1e-6)
    assert out.per_sample["implicit_accuracy"].item() == 0.0
    out.loss.backward()
    # d loss / d e_w = sigmoid(1.25) * beta / 2 > 0; d e_w / d v = (v - target) = [1, 0]
    s = 1.0 / (1.0 + math.exp(-1.25))
    assert v.grad[0].tolist() == pytest.approx([s * 0.5 * 1.0, 0.0], abs=1e-6)
    # gradient descent moves the chosen sample's velocity towards its target: e_w shrinks


def test_beta_scales_inside_term():
    out = DiffusionDPOLoss(DiffusionDPOLoss.Config(dpo_beta=2.0))(
        _inputs(torch.tensor([[2.0, 0.0]]))
    )
    assert out.loss.item() == pytest.approx(-math.log(1.0 / (1.0 + math.exp(2.5))), abs=1e-6)


def _sample(rollout, index, rewards):
    fields = lease_sampling("diffusion_dpo", seed=index, step=0, num_steps=3)
    sampling = SamplingParams(
        group_size=3, num_steps=3, guidance_scale=1.0, height=32, width=32, seed=7, **fields
    )
    prompt = PromptSpec(group_id=f"g{index}", text=f"a photo of thing {index}")
    (group,) = rollout.sample(
        [prompt], sampling, lease_id=f"l{index}", worker_id="w", policy_version=0
    )
    return msgspec.structs.replace(group, rewards=Rewards(group_id=group.group_id, total=rewards))


def test_one_step_on_tiny_sd3_and_staleness(tiny_sd3_path, torch_one_thread):
    rollout = get_rollout_adapter(ARCH, "diffusion_dpo").from_pretrained(tiny_sd3_path)
    groups = [_sample(rollout, 0, [0.0, 1.0, 0.5]), _sample(rollout, 1, [2.0, 2.0, 2.0])]
    assert groups[0].latents is None and groups[0].log_probs is None
    runs = []
    for version in (0, 2):
        torch.manual_seed(0)
        adapter = get_training_adapter(ARCH, "diffusion_dpo").from_pretrained(
            tiny_sd3_path, lora=LORA
        )
        before = [p.detach().clone() for p in adapter.trainable_parameters()]
        step = TrainStep(adapter, "diffusion_dpo", TrainStep.Config(lr=1e-2))
        assert isinstance(step, ForwardProcessStep) and step.old is None
        m = step.step(groups, policy_version=version)
        assert all(math.isfinite(v) for v in m.values()), m
        assert m["skipped_groups"] == 1  # the tied group has no pair
        assert m["num_samples"] == 2 and m["trained_steps"] == 2 and m["optimizer_steps"] == 1
        # at the first update theta is the reference up to the LoRA's own (gaussian) init:
        # the loss is finite and the weights move
        after = [p.detach() for p in adapter.trainable_parameters()]
        assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))
        runs.append((m, [p.clone() for p in after]))
    (fresh, p_fresh), (stale, p_stale) = runs
    assert stale["staleness_max"] == 2.0 and stale["loss"] == fresh["loss"]
    assert all(torch.equal(a, b) for a, b in zip(p_fresh, p_stale, strict=True))
