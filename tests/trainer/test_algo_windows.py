"""Window policies (Flow-GRPO-Fast, MixGRPO), the lease's sampling fields, window buckets."""

from types import SimpleNamespace

import pytest
import torch

from omnirl.trainer.algorithms.registry import get_algorithm, known_algorithms
from omnirl.trainer.algorithms.windows import (
    WindowPolicy,
    get_window_policy,
    lease_sampling,
    lease_window,
    window_buckets,
)


def test_every_new_algorithm_is_one_key_and_aliases_flow_grpo_parts():
    for name in ("flow_grpo_fast", "mix_grpo", "dance_grpo", "grpo_guard", "flow_dppo"):
        assert name in known_algorithms()
    fast, mix = get_algorithm("flow_grpo_fast"), get_algorithm("mix_grpo")
    assert (fast.window_policy, mix.window_policy) == ("flow_grpo_fast", "mix_grpo")
    for spec in (fast, mix):
        assert (spec.loss, spec.advantage, spec.sde_type, spec.alias_of) == (
            "flow_grpo",
            "group",
            "sde",
            "flow_grpo",
        )
    assert get_algorithm("flow_grpo").window_policy is None
    assert get_algorithm("flow_dppo").defaults["adv_clip_max"] == float("inf")  # no clamp
    assert get_algorithm("grpo_guard").defaults["adv_clip_max"] == 5.0
    dance = get_algorithm("dance_grpo")
    assert dance.defaults["timestep_fraction"] == 0.6
    assert dance.defaults["timestep_selection"] == "random"


def test_random_window_depends_on_the_seed_only_and_stays_in_range():
    policy = get_window_policy("flow_grpo_fast")  # size 2 in [0, 5), flow_grpo's defaults
    windows = {policy.window(seed=s, step=0, num_steps=10) for s in range(64)}
    assert windows == {(0, 2), (1, 3), (2, 4), (3, 5)}
    for seed in (0, 7, 123456789):
        w = policy.window(seed=seed, step=0, num_steps=10)
        assert all(policy.window(seed=seed, step=t, num_steps=10) == w for t in (1, 50, 999))


def test_progressive_window_slides_every_interval_then_rolls_back_or_stays():
    mix = get_window_policy("mix_grpo")  # size 4, every 25 steps, stride 1, roll back
    w = [mix.window(seed=s, step=t, num_steps=10) for s, t in [(0, 0), (9, 24), (0, 25), (0, 150)]]
    assert w == [(0, 4), (0, 4), (1, 5), (6, 10)]  # 7 positions: 0..6
    assert mix.window(seed=0, step=175, num_steps=10) == (0, 4)  # move 7 -> back to 0
    stay = WindowPolicy(name="t", size=3, schedule="progressive", shift_interval=2, stride=2)
    # T=8, range [0, 8): starts 0, 2, 4 (3 positions, 4+3 <= 8), then it stays at 4
    assert [stay.window(seed=0, step=t, num_steps=8)[0] for t in range(0, 10, 2)] == [0, 2, 4, 4, 4]


def test_lease_sampling_takes_config_first_then_the_algorithm():
    fast = lease_sampling("flow_grpo_fast", seed=3, step=0, num_steps=10)
    start, end = fast["sde_window"]
    assert end - start == 2 and start >= 0 and end <= 5
    assert fast["noise_level"] == 0.7 and fast["same_initial_noise"] is False
    assert lease_sampling("flow_grpo_fast", seed=3, step=0, num_steps=10, sde_window=[4, 9])[
        "sde_window"
    ] == (4, 9)
    dance = lease_sampling("dance_grpo", seed=3, step=0, num_steps=10)
    assert dance == {
        "sde_type": "dance_sde",
        "noise_level": 0.3,
        "sde_window": None,
        "same_initial_noise": True,
    }
    assert (
        lease_sampling("dance_grpo", seed=3, step=0, num_steps=10, noise_level=0.5)["noise_level"]
        == 0.5
    )
    for algorithm, configured in (("flow_grpo", True), ("dance_grpo", False)):
        fields = lease_sampling(
            algorithm, seed=3, step=0, num_steps=10, same_initial_noise=configured
        )
        assert fields["same_initial_noise"] is configured  # the config wins both ways
    assert lease_window(None, seed=0, step=0, num_steps=10) is None
    with pytest.raises(ValueError, match="sde_window"):
        lease_window(None, seed=0, step=0, num_steps=10, configured=(3, 3))
    with pytest.raises(LookupError, match="known: flow_grpo_fast"):
        lease_window("nope", seed=0, step=0, num_steps=10)


def _group(gid, steps, sigmas, num_steps=10):
    return SimpleNamespace(
        group_id=gid,
        step_indices=torch.tensor(steps),
        sigmas=torch.tensor(sigmas),
        sampling=SimpleNamespace(num_steps=num_steps),
    )


def test_window_buckets_split_windows_and_refuse_disagreeing_schedules():
    a = _group("a", [0, 1], [1.0, 0.9])
    b = _group("b", [1, 2], [0.9, 0.8])
    c = _group("c", [0, 1], [1.0, 0.9])
    assert window_buckets([a, b, c]) == [[0, 2], [1]]
    wrong = _group("d", [0, 1], [0.9, 0.8])  # step 0 at sigma 0.9: a window shifted by hand
    with pytest.raises(ValueError, match="windows"):
        window_buckets([a, wrong])
    assert window_buckets([a, _group("e", [0, 1], [0.5, 0.4], num_steps=4)]) == [[0], [1]]
