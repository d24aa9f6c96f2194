"""Group advantages on hand-computed examples."""

import math

import pytest
import torch

from omnirl.trainer.algorithms.advantages import group_advantages
from omnirl.trainer.algorithms.registry import get_advantage

EPS = 1e-4


def _close(t: torch.Tensor, expected: list[float], tol: float = 1e-6) -> None:
    assert t.dtype == torch.float32
    assert t.tolist() == pytest.approx(expected, abs=tol)


def test_group_std_is_the_population_std_of_the_prompts_own_group():
    # [0, 4]: mean 2, population std 2 (the unbiased std would be 2.83);
    # [1, 3]: mean 2, population std 1.
    res = group_advantages([[0.0, 4.0], [1.0, 3.0]], std="group")
    _close(res.advantages[0], [-2 / (2 + EPS), 2 / (2 + EPS)])
    _close(res.advantages[1], [-1 / (1 + EPS), 1 / (1 + EPS)])
    assert res.zero_groups == []


def test_global_std_is_the_population_std_over_the_whole_batch():
    # all rewards [0, 4, 1, 3]: mean 2, squared deviations 4, 4, 1, 1 -> var 10 / 4.
    s = math.sqrt(10 / 4)
    res = group_advantages([[0.0, 4.0], [1.0, 3.0]], std="global")
    _close(res.advantages[0], [-2 / (s + EPS), 2 / (s + EPS)])
    _close(res.advantages[1], [-1 / (s + EPS), 1 / (s + EPS)])


def test_centering_uses_the_group_mean_not_the_batch_mean():
    res = group_advantages([[10.0, 12.0], [0.0, 2.0]], std="group")
    _close(res.advantages[0], [-1 / (1 + EPS), 1 / (1 + EPS)])
    _close(res.advantages[1], [-1 / (1 + EPS), 1 / (1 + EPS)])


def test_clamp_at_adv_clip_max():
    # 50 zeros and one 1: p = 1/51, the 1 gets (1 - p) / sqrt(p (1 - p)) = sqrt(50) ~ 7.07.
    rewards = [[0.0] * 50 + [1.0]]
    p = 1 / 51
    std = math.sqrt(p * (1 - p))
    free = group_advantages(rewards, std="group", adv_clip_max=None).advantages[0]
    assert free[-1].item() == pytest.approx((1 - p) / (std + EPS), rel=1e-6)
    assert free[-1].item() > 7.0
    clamped = group_advantages(rewards, std="group", adv_clip_max=5.0).advantages[0]
    assert clamped[-1].item() == 5.0
    assert clamped[0].item() == pytest.approx(-p / (std + EPS), rel=1e-6)  # not clamped


def test_singleton_group_gets_zero_and_is_reported():
    res = group_advantages([[3.0], [1.0, 2.0]], std="global")
    assert res.advantages[0].tolist() == [0.0]
    assert res.zero_groups == [0]
    assert res.advantages[1].abs().min().item() > 0


def test_all_equal_group_is_exactly_zero_and_skipped():
    # 0.1 * 3 / 3 != 0.1 in floating point; the advantages must still be exactly 0.
    res = group_advantages([[0.1, 0.1, 0.1], [0.0, 1.0]], std="global")
    assert res.advantages[0].tolist() == [0.0, 0.0, 0.0]
    assert res.zero_groups == [0]


def test_bad_input_is_refused_with_a_clear_error():
    with pytest.raises(ValueError, match="std must be one of"):
        group_advantages([[1.0, 2.0]], std="batch")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-finite"):
        group_advantages([[1.0, float("nan")]])
    with pytest.raises(ValueError, match="no rewards"):
        group_advantages([[]])
    with pytest.raises(ValueError, match="no reward groups"):
        group_advantages([])


def test_registered_as_group():
    assert get_advantage("group") is group_advantages
