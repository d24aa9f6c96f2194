"""One TrainStep of each log-prob algorithm on the tiny SD3: it runs, moves the LoRA weights,
and treats a stale group as docs/algorithms.md says (behaviour weight, no clip / mask from
staleness, the recorded window still trained).

Sizes are the smallest that exercise everything: 2 groups x 2 samples, 3 steps, 32x32.
The FlowGRPO (sde and cps) / Fast / MixGRPO / Guard / DPPO batches mix two windows ((0, 2)
and (1, 3)), as leases with their own windows produce.
"""

import math

import msgspec
import pytest
import torch

from omnirl.models.registry import get_rollout_adapter, get_training_adapter
from omnirl.protocol.messages import PromptSpec, Rewards, SamplingParams
from omnirl.trainer.algorithms.windows import lease_sampling
from omnirl.trainer.step import TrainStep

ARCH = "StableDiffusion3Pipeline"
LORA = {"r": 4, "lora_alpha": 4}


def _sample(rollout, algorithm, window, index, rewards):
    fields = lease_sampling(algorithm, seed=index, step=0, num_steps=3, sde_window=window)
    sampling = SamplingParams(
        group_size=2, num_steps=3, guidance_scale=1.0, height=32, width=32, seed=11, **fields
    )
    prompt = PromptSpec(group_id=f"g{index}", text=f"a photo of thing {index}")
    (group,) = rollout.sample(
        [prompt], sampling, lease_id=f"l{index}", worker_id="w", policy_version=0
    )
    return msgspec.structs.replace(group, rewards=Rewards(group_id=group.group_id, total=rewards))


@pytest.fixture(scope="module")
def groups(tiny_sd3_path):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    rollout = get_rollout_adapter(ARCH, "flow_grpo").from_pretrained(tiny_sd3_path)
    out = {
        "sde": [
            _sample(rollout, "flow_grpo_fast", (0, 2), 0, [0.0, 1.0]),
            _sample(rollout, "flow_grpo_fast", (1, 3), 1, [2.0, 0.0]),
        ],
        "cps": [
            _sample(rollout, "flow_grpo_cps", (0, 2), 0, [0.0, 1.0]),
            _sample(rollout, "flow_grpo_cps", (1, 3), 1, [2.0, 0.0]),
        ],
        "dance_sde": [
            _sample(rollout, "dance_grpo", None, 0, [0.0, 1.0]),
            _sample(rollout, "dance_grpo", None, 1, [2.0, 0.0]),
        ],
    }
    torch.set_num_threads(before)
    return out


def _lora(adapter):
    return [p.detach().clone() for p in adapter.trainable_parameters()]


@pytest.mark.parametrize(
    ("algorithm", "sde_type", "trained"),
    [
        ("flow_grpo", "sde", 2),
        ("flow_grpo_cps", "cps", 2),
        ("flow_grpo_fast", "sde", 2),
        ("mix_grpo", "sde", 2),
        ("grpo_guard", "sde", 2),
        ("flow_dppo", "sde", 2),
        ("dance_grpo", "dance_sde", 1),  # int(0.6 * 3 recorded steps)
    ],
)
def test_one_step_moves_lora_and_a_stale_group_is_weighted_not_clipped(
    tiny_sd3_path, groups, torch_one_thread, algorithm, sde_type, trained
):
    batch = groups[sde_type]
    if sde_type != "dance_sde":
        assert [g.step_indices.tolist() for g in batch] == [[0, 1], [1, 2]]
    else:
        assert all(g.sampling.same_initial_noise for g in batch)
        assert torch.equal(batch[0].latents[0, 0], batch[0].latents[1, 0])  # one x_T a prompt
    adapter = get_training_adapter(ARCH, "flow_grpo").from_pretrained(tiny_sd3_path, lora=LORA)
    before = _lora(adapter)
    step = TrainStep(adapter, algorithm, TrainStep.Config(lr=1e-2))
    m = step.step(batch, policy_version=0)
    assert all(math.isfinite(v) for v in m.values()), m
    assert m["optimizer_steps"] == 1 and m["num_samples"] == 4 and m["trained_steps"] == trained
    assert m["behav_prox_logp_absdiff_max"] < 1e-5  # on-policy: rollout and trainer agree
    assert abs(m["ratio_mean"] - 1.0) < 1e-6 and m["grad_norm"] > 0
    assert any(
        not torch.equal(a, b.detach())
        for a, b in zip(before, adapter.trainable_parameters(), strict=True)
    )

    # Two versions later the same groups are stale: the ratio is taken against the trainer's
    # own (proximal) log-probs, so it is 1 and nothing is clipped or masked; the staleness
    # shows in the behaviour weight exp(prox - behav) instead.
    m2 = step.step(batch, policy_version=2)
    assert m2["staleness_max"] == 2.0 and m2["trained_steps"] == trained
    assert m2["behav_prox_logp_absdiff_max"] > 1e-5
    assert m2["importance_weight_mean"] != 1.0
    assert m2["clip_frac"] == 0.0 and abs(m2["ratio_mean"] - 1.0) < 1e-6


@pytest.mark.parametrize("algorithm", ["grpo_guard", "flow_dppo"])
def test_two_updates_use_the_proximal_step_means(
    tiny_sd3_path, groups, torch_one_thread, algorithm
):
    adapter = get_training_adapter(ARCH, "flow_grpo").from_pretrained(tiny_sd3_path, lora=LORA)
    config = TrainStep.Config(lr=1e-2, num_minibatches=2, kl_mask_threshold=1e-12)
    step = TrainStep(adapter, algorithm, config)
    m = step.step(groups["sde"], policy_version=0)
    assert m["optimizer_steps"] == 2 and all(math.isfinite(v) for v in m.values()), m
    # the second update's policy moved away from the proximal one
    assert m["ratio_std"] > 0
