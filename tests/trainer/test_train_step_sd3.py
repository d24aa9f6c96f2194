"""TrainStep on the tiny SD3: rollout and trainer agree on-policy, and one step moves the policy.

Sizes are the smallest that exercise everything (2 groups x 2 samples, 3 steps, an SDE
window of 2; CFG only for cps) because every forward pass costs CPU time on a shared machine.
"""

import math
import os

import msgspec
import pytest
import torch

from omnirl.models.registry import get_rollout_adapter, get_training_adapter
from omnirl.models.transitions import collate_transitions
from omnirl.protocol.messages import PromptSpec, Rewards, SamplingParams
from omnirl.trainer.algorithms.registry import get_algorithm
from omnirl.trainer.step import TrainStep, TrainStepInputError

ARCH = "StableDiffusion3Pipeline"
DEVICE = os.environ.get("OMNIRL_TEST_DEVICE", "cpu")  # as tests/conftest.py's test_device
LORA = {"r": 4, "lora_alpha": 4}
ALGORITHM_OF_SDE = {"sde": "flow_grpo", "cps": "flow_grpo_cps", "dance_sde": "dance_grpo"}
METRICS = frozenset(
    {
        *("loss", "policy_loss", "kl", "ratio_mean", "ratio_std", "clip_frac", "approx_kl"),
        *("grad_norm", "reward_mean", "reward_std", "adv_abs_mean", "staleness_mean"),
        *("staleness_max", "behav_prox_logp_absdiff_mean", "behav_prox_logp_absdiff_max"),
        *("importance_weight_mean", "skipped_groups", "num_samples", "time_s"),
    }
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The tiny model gains nothing from intra-op threads, and on a shared 2-core machine
    their synchronisation makes each forward pass 10x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _sample(rollout, algorithm: str, *, num_steps=3, window=(0, 2), guidance_scale=1.0):
    spec = get_algorithm(algorithm)
    sampling = SamplingParams(
        group_size=2,
        num_steps=num_steps,
        guidance_scale=guidance_scale,
        height=32,
        width=32,
        sde_window=window,
        seed=7,
        **{k: v for k, v in spec.sampling_defaults.items() if k != "same_initial_noise"},
    )
    prompts = [PromptSpec(group_id=f"g{i}", text=f"a photo of thing {i}") for i in range(2)]
    groups = rollout.sample(prompts, sampling, lease_id="l0", worker_id="w0", policy_version=0)
    return _with_rewards(groups, ((0.0, 1.0), (2.0, 0.0)))


def _with_rewards(groups, rewards):
    return [
        msgspec.structs.replace(g, rewards=Rewards(group_id=g.group_id, total=list(r)))
        for g, r in zip(groups, rewards, strict=True)
    ]


def _trainer(path, lora=LORA):
    return get_training_adapter(ARCH, "flow_grpo").from_pretrained(path, device=DEVICE, lora=lora)


def _max_ratio_dev(adapter, groups, sde_type: str) -> float:
    devs = []
    with torch.no_grad():
        for k in range(int(groups[0].latents.shape[1])):
            batch = collate_transitions(groups, k)
            lp = adapter.transition(batch, sde_type=sde_type).log_prob.cpu()
            devs.append((torch.exp(lp - batch.old_log_probs) - 1).abs().max().item())
    return max(devs)


@pytest.fixture(scope="module")
def groups_by_sde(tiny_sd3_path):
    rollout = get_rollout_adapter(ARCH, "flow_grpo").from_pretrained(tiny_sd3_path, device=DEVICE)
    # "sde": window (1, 3) leaves step 0 deterministic (and untrained); the others start
    # at sigma = 1, where the sde step's variance needs its special case.
    return {
        "sde": _sample(rollout, "flow_grpo", window=(1, 3)),
        "cps": _sample(rollout, "flow_grpo_cps", guidance_scale=4.5),  # with CFG
        "dance_sde": _sample(rollout, "dance_grpo"),
    }


@pytest.mark.parametrize("sde_type", ["sde", "cps", "dance_sde"])
def test_on_policy_ratio_is_one_then_moves_after_one_step(tiny_sd3_path, groups_by_sde, sde_type):
    groups = groups_by_sde[sde_type]
    adapter = _trainer(tiny_sd3_path)
    assert _max_ratio_dev(adapter, groups, sde_type) < 1e-5
    step = TrainStep(adapter, ALGORITHM_OF_SDE[sde_type], TrainStep.Config(lr=1e-2))
    m = step.step(groups, policy_version=0)
    assert set(m) >= METRICS
    assert all(math.isfinite(v) for v in m.values()), m
    assert m["behav_prox_logp_absdiff_max"] < 1e-5  # the rollout/trainer parity metric
    assert m["optimizer_steps"] == 1 and m["num_samples"] == 4 and m["grad_norm"] > 0
    assert _max_ratio_dev(adapter, groups, sde_type) > 1e-5

    # The same groups one version later: stale by 1, corrected by the importance weight.
    m2 = step.step(groups, policy_version=1)
    assert m2["staleness_mean"] == 1.0 and m2["staleness_max"] == 1.0
    assert m2["behav_prox_logp_absdiff_max"] > 1e-5
    assert m2["importance_weight_mean"] != 1.0


def test_lora_changes_only_adapter_params_and_reference_stays_the_base(
    tiny_sd3_path, groups_by_sde
):
    groups = groups_by_sde["sde"]
    adapter = _trainer(tiny_sd3_path)
    trainable_ids = {id(p) for p in adapter.trainable_parameters()}
    named = dict(adapter.transformer.named_parameters())
    base_before = {n: p.detach().clone() for n, p in named.items() if id(p) not in trainable_ids}
    lora_before = {n: p.detach().clone() for n, p in named.items() if id(p) in trainable_ids}
    assert lora_before and all("lora" in n for n in lora_before)
    batch = collate_transitions(groups, 0)
    with torch.no_grad():
        mean_before = adapter.transition(batch, sde_type="sde").prev_sample_mean

    step = TrainStep(adapter, "flow_grpo", TrainStep.Config(lr=1e-2, kl_beta=0.1))
    m1 = step.step(groups, policy_version=0)
    assert m1["kl"] == 0.0  # the policy is the reference before the first update
    for n, before in base_before.items():
        assert torch.equal(named[n].detach(), before), f"base parameter {n} changed"
    assert any(not torch.equal(named[n].detach(), v) for n, v in lora_before.items())

    with torch.no_grad():
        mean_after = adapter.transition(batch, sde_type="sde").prev_sample_mean
        with adapter.reference():
            mean_ref = adapter.transition(batch, sde_type="sde").prev_sample_mean
    assert not torch.allclose(mean_after, mean_ref, rtol=0, atol=1e-7)
    torch.testing.assert_close(mean_ref, mean_before, rtol=0, atol=1e-6)
    m2 = step.step(groups, policy_version=1)
    assert m2["kl"] > 0


def test_only_recorded_window_steps_are_trained(tiny_sd3_path, groups_by_sde):
    groups = groups_by_sde["sde"]
    assert groups[0].step_indices.tolist() == [1, 2]
    adapter = _trainer(tiny_sd3_path)
    seen: list[tuple[int, bool]] = []
    transition = adapter.transition

    def spy(batch, *, sde_type):
        out = transition(batch, sde_type=sde_type)
        seen.append((batch.step_index, out.log_prob.requires_grad))
        return out

    adapter.transition = spy
    step = TrainStep(adapter, "flow_grpo", TrainStep.Config(lr=1e-3))
    step.step(groups, policy_version=0)
    assert seen == [(1, True), (2, True)]
    seen.clear()
    half = TrainStep(adapter, "flow_grpo", TrainStep.Config(lr=1e-3, timestep_fraction=0.5))
    m = half.step(groups, policy_version=0)
    assert seen == [(1, True)] and m["trained_steps"] == 1


def test_full_finetuning_changes_base_params_and_ema_follows(tiny_sd3_path, groups_by_sde):
    adapter = _trainer(tiny_sd3_path, lora=None)
    params = adapter.trainable_parameters()
    assert len(params) == len(list(adapter.transformer.parameters()))
    before = [p.detach().clone() for p in params]
    step = TrainStep(
        adapter, "flow_grpo", TrainStep.Config(lr=1e-3, ema_decay=0.5, ema_warmup=False)
    )
    step.step(groups_by_sde["sde"], policy_version=0)
    changed = [not torch.equal(p.detach(), b) for p, b in zip(params, before, strict=True)]
    assert sum(changed) > len(params) // 2
    # EMA after one update with decay 0.5: halfway between the start and the new weights.
    for shadow, p, b in zip(step.ema.shadow, params, before, strict=True):
        torch.testing.assert_close(shadow, 0.5 * b + 0.5 * p.detach(), rtol=0, atol=1e-7)


def test_tied_groups_are_skipped_and_all_tied_means_no_update(tiny_sd3_path, groups_by_sde):
    groups = _with_rewards(groups_by_sde["sde"], ((1.0, 1.0), (0.0, 1.0)))
    adapter = _trainer(tiny_sd3_path)
    step = TrainStep(adapter, "flow_grpo", TrainStep.Config(lr=1e-3))
    m = step.step(groups, policy_version=0)
    assert m["skipped_groups"] == 1 and m["num_samples"] == 2 and m["optimizer_steps"] == 1

    before = [p.detach().clone() for p in adapter.trainable_parameters()]
    m = step.step(groups[:1], policy_version=0)
    assert m["skipped_groups"] == 1 and m["num_samples"] == 0 and m["optimizer_steps"] == 0
    assert all(
        torch.equal(p.detach(), b)
        for p, b in zip(adapter.trainable_parameters(), before, strict=True)
    )
    assert all(math.isfinite(v) for v in m.values())


def test_minibatches_recompute_the_proximal_policy_and_state_round_trips(
    tiny_sd3_path, groups_by_sde
):
    adapter = _trainer(tiny_sd3_path)
    config = TrainStep.Config(lr=1e-2, num_minibatches=2, micro_batch_size=1, seed=3)
    step = TrainStep(adapter, "flow_grpo", config)
    m = step.step(groups_by_sde["sde"], policy_version=0)
    assert m["optimizer_steps"] == 2
    # the second update's ratios are taken against the proximal policy of the first.
    assert m["ratio_std"] > 0 and m["behav_prox_logp_absdiff_max"] < 1e-5

    state = step.state_dict()
    other = TrainStep(_trainer(tiny_sd3_path), "flow_grpo", config)
    other.load_state_dict(state)
    assert other.num_updates == 2
    assert torch.equal(
        torch.randperm(10, generator=other.generator), torch.randperm(10, generator=step.generator)
    )
    with pytest.raises(ValueError, match="algorithm"):
        TrainStep(_trainer(tiny_sd3_path), "flow_grpo_cps", config).load_state_dict(state)


def test_bad_groups_are_refused_before_anything_changes(tiny_sd3_path, groups_by_sde):
    step = TrainStep(_trainer(tiny_sd3_path), "flow_grpo_cps")
    assert step.config.clip_range == 1e-5  # the algorithm's default
    with pytest.raises(TrainStepInputError, match="sde_type"):
        step.step(groups_by_sde["sde"], policy_version=0)
    step = TrainStep(_trainer(tiny_sd3_path), "flow_grpo")
    with pytest.raises(TrainStepInputError, match="newer"):
        step.step(groups_by_sde["sde"], policy_version=-1)
    with pytest.raises(TrainStepInputError, match="no groups"):
        step.step([], policy_version=0)
    a, b = groups_by_sde["sde"]
    other_window = msgspec.structs.replace(b, step_indices=b.step_indices - 1)
    with pytest.raises(TrainStepInputError, match="window"):
        step.step([a, other_window], policy_version=0)
    assert step.num_updates == 0
    with pytest.raises(ValueError, match="timestep_fraction"):
        TrainStep(_trainer(tiny_sd3_path), "flow_grpo", TrainStep.Config(timestep_fraction=0))
    with pytest.raises(TypeError, match=r"unknown TrainStep\.Config keys"):
        TrainStep.Config.from_dict({"lr": 1e-3, "clip_rnage": 1e-4})


def _grads_at_optimizer_step(step: TrainStep) -> list[list[torch.Tensor]]:
    """Record the gradients the optimiser sees (after accumulation and clipping)."""
    seen: list[list[torch.Tensor]] = []
    inner = step.optimizer.step

    def spy(*args, **kwargs):
        seen.append([p.grad.detach().clone() for p in step.params])
        return inner(*args, **kwargs)

    step.optimizer.step = spy
    return seen


def test_accumulating_over_timesteps_and_micro_batches_gives_the_full_batch_gradient(
    tiny_sd3_path, groups_by_sde
):
    grads = {}
    for micro in (0, 1):  # 0: each timestep's 4 samples at once; 1: 8 backward passes
        torch.manual_seed(0)  # the same random LoRA A matrices in both
        step = TrainStep(
            _trainer(tiny_sd3_path), "flow_grpo", TrainStep.Config(lr=1e-3, micro_batch_size=micro)
        )
        seen = _grads_at_optimizer_step(step)
        m = step.step(groups_by_sde["sde"], policy_version=0)
        assert m["trained_steps"] == 2 and len(seen) == 1
        grads[micro] = seen[0]
    assert any(g.abs().max() > 0 for g in grads[0])
    for whole, accumulated in zip(grads[0], grads[1], strict=True):
        torch.testing.assert_close(accumulated, whole, rtol=1e-4, atol=1e-9)


def test_gradient_clipping_caps_the_norm_the_optimiser_sees(tiny_sd3_path, groups_by_sde):
    step = TrainStep(
        _trainer(tiny_sd3_path), "flow_grpo", TrainStep.Config(lr=1e-3, max_grad_norm=1e-7)
    )
    seen = _grads_at_optimizer_step(step)
    m = step.step(groups_by_sde["sde"], policy_version=0)
    clipped = torch.linalg.vector_norm(torch.stack([g.norm() for g in seen[0]]))
    assert m["grad_norm"] > 1e-6  # reported: the norm before clipping
    assert float(clipped) == pytest.approx(1e-7, rel=1e-2)  # torch adds 1e-6 to the norm


def test_lr_scale_sets_the_step_learning_rate(tiny_sd3_path, groups_by_sde):
    """The run's schedule reaches the optimiser: scale 0 leaves the policy as it was."""
    groups = groups_by_sde["sde"]
    adapter = _trainer(tiny_sd3_path)
    step = TrainStep(adapter, "flow_grpo", TrainStep.Config(lr=2e-3))
    before = [p.detach().clone() for p in adapter.trainable_parameters()]
    m = step.step(groups, policy_version=0, lr_scale=0.0)
    assert m["lr"] == 0.0
    after = list(adapter.trainable_parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    m = step.step(groups, policy_version=0, lr_scale=0.5)
    assert m["lr"] == pytest.approx(1e-3)
    assert step.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3)
    assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))
