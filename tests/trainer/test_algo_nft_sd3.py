"""DiffusionNFT on the tiny SD3: the wire carries only clean latents and conditioning, one
step moves the LoRA weights, the old policy lags, and a stale group trains like a fresh one.

Sizes: 2 groups x 2 samples, 3 ODE steps, 32x32.
"""

import math

import msgspec
import pytest
import torch

from omnirl.models.registry import get_rollout_adapter, get_training_adapter
from omnirl.protocol.codec import encode, encoded_size
from omnirl.protocol.messages import PromptSpec, Rewards, SamplingParams
from omnirl.trainer.algorithms.windows import lease_sampling
from omnirl.trainer.forward_step import ForwardProcessStep
from omnirl.trainer.step import TrainStep, TrainStepInputError

ARCH = "StableDiffusion3Pipeline"
LORA = {"r": 4, "lora_alpha": 4}
TRANSITION_FIELDS = (
    "step_indices",
    "timesteps",
    "sigmas",
    "next_sigmas",
    "noise_levels",
    "latents",
    "next_latents",
    "log_probs",
)


def _sample(rollout, algorithm, index, rewards):
    fields = lease_sampling(algorithm, seed=index, step=0, num_steps=3)
    sampling = SamplingParams(
        group_size=2, num_steps=3, guidance_scale=1.0, height=32, width=32, seed=5, **fields
    )
    prompt = PromptSpec(group_id=f"g{index}", text=f"a photo of thing {index}")
    (group,) = rollout.sample(
        [prompt], sampling, lease_id=f"l{index}", worker_id="w", policy_version=0
    )
    return msgspec.structs.replace(group, rewards=Rewards(group_id=group.group_id, total=rewards))


@pytest.fixture(scope="module")
def sampled(tiny_sd3_path):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    rollout = get_rollout_adapter(ARCH, "diffusion_nft").from_pretrained(tiny_sd3_path)
    out = {
        "nft": [
            _sample(rollout, "diffusion_nft", 0, [0.0, 1.0]),
            _sample(rollout, "diffusion_nft", 1, [2.0, 0.0]),
        ],
        "grpo": _sample(rollout, "flow_grpo", 0, [0.0, 1.0]),
    }
    torch.set_num_threads(before)
    return out


def _params(adapter):
    return [p.detach().clone() for p in adapter.trainable_parameters()]


def test_nft_groups_carry_no_transitions_and_are_smaller_on_the_wire(sampled):
    nft, grpo = sampled["nft"][0], sampled["grpo"]
    assert nft.sampling.sde_type == "ode"
    for name in TRANSITION_FIELDS:
        assert getattr(nft, name) is None, name
        assert getattr(grpo, name) is not None, name
    assert nft.final_latents.shape == grpo.final_latents.shape
    assert nft.prompt_embeds is not None
    nft_bytes, grpo_bytes = encoded_size(encode(nft)), encoded_size(encode(grpo))
    # FlowGRPO adds latents + next_latents [G, K, C, h, w] and log-probs [G, K] (K = 3 steps)
    latent = grpo.final_latents[0].numel() * 4
    assert grpo_bytes - nft_bytes >= 2 * 2 * 3 * latent


def test_train_step_dispatches_and_one_step_moves_lora(tiny_sd3_path, sampled, torch_one_thread):
    adapter = get_training_adapter(ARCH, "diffusion_nft").from_pretrained(tiny_sd3_path, lora=LORA)
    before = _params(adapter)
    step = TrainStep(adapter, "diffusion_nft", TrainStep.Config(lr=1e-2))
    assert isinstance(step, ForwardProcessStep)
    assert step.config.nft_beta == 1.0 and step.config.kl_beta == 1e-4
    m = step.step(sampled["nft"], policy_version=0)
    assert all(math.isfinite(v) for v in m.values()), m
    assert m["optimizer_steps"] == 1 and m["num_samples"] == 4
    assert m["trained_steps"] == 2  # int(3 * 0.99) levels per sample
    assert m["grad_norm"] > 0 and m["loss"] > 0
    # at the first update theta == old: the old policy's velocity is the trained one's
    assert m["old_deviation_mean"] < 1e-10
    after = _params(adapter)
    assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))
    # the old policy moved to d * old + (1 - d) * theta with d = min(0.001 * 1, 0.5)
    assert m["old_decay"] == pytest.approx(0.001)
    for b, a, o in zip(before, after, step.old.shadow, strict=True):
        assert torch.allclose(o, 0.001 * b + 0.999 * a, atol=1e-7)


def test_a_stale_group_trains_exactly_like_a_fresh_one(tiny_sd3_path, sampled, torch_one_thread):
    runs = []
    for version in (0, 2):
        torch.manual_seed(0)
        adapter = get_training_adapter(ARCH, "diffusion_nft").from_pretrained(
            tiny_sd3_path, lora={**LORA, "init_lora_weights": "gaussian"}
        )
        step = TrainStep(adapter, "diffusion_nft", TrainStep.Config(lr=1e-2, kl_beta=0.0))
        m = step.step(sampled["nft"], policy_version=version)
        runs.append((m, _params(adapter)))
    (fresh, p_fresh), (stale, p_stale) = runs
    assert fresh["staleness_max"] == 0.0 and stale["staleness_max"] == 2.0
    assert stale["loss"] == fresh["loss"] and stale["old_deviation_mean"] == 0.0
    assert all(torch.equal(a, b) for a, b in zip(p_fresh, p_stale, strict=True))


def test_bad_groups_are_refused_by_name(tiny_sd3_path, sampled, torch_one_thread):
    adapter = get_training_adapter(ARCH, "diffusion_nft").from_pretrained(tiny_sd3_path, lora=LORA)
    step = TrainStep(adapter, "diffusion_nft")
    g = sampled["nft"][0]
    with pytest.raises(TrainStepInputError, match="final_latents"):
        step.step([msgspec.structs.replace(g, final_latents=None)], policy_version=0)
    with pytest.raises(TrainStepInputError, match="newer"):
        step.step([msgspec.structs.replace(g, policy_version=3)], policy_version=1)
    with pytest.raises(TrainStepInputError, match="rewards for"):
        step.step(
            [msgspec.structs.replace(g, rewards=Rewards(group_id="g0", total=[1.0]))],
            policy_version=0,
        )
    # all-tied groups are skipped: no update
    tied = msgspec.structs.replace(g, rewards=Rewards(group_id="g0", total=[1.0, 1.0]))
    m = step.step([tied], policy_version=0)
    assert m["skipped_groups"] == 1 and m["optimizer_steps"] == 0


def test_state_dict_round_trip_keeps_the_old_policy(tiny_sd3_path, sampled, torch_one_thread):
    adapter = get_training_adapter(ARCH, "diffusion_nft").from_pretrained(tiny_sd3_path, lora=LORA)
    step = TrainStep(adapter, "diffusion_nft", TrainStep.Config(lr=1e-2, kl_beta=0.0))
    step.step(sampled["nft"], policy_version=0)
    state = step.state_dict()
    other = TrainStep(adapter, "diffusion_nft", TrainStep.Config(lr=1e-2, kl_beta=0.0))
    other.load_state_dict(state)
    assert other.num_updates == 1
    assert all(torch.equal(a, b) for a, b in zip(other.old.shadow, step.old.shadow, strict=True))
