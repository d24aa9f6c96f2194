"""Learning-rate schedules over a run's progress, and their config checks."""

import math

import pytest

from omnirl.trainer.config import ConfigError, load_config
from omnirl.trainer.lr_schedule import lr_factor, run_progress, warmup_factor


def test_factors_at_start_middle_and_end():
    assert [lr_factor("constant", p) for p in (0, 0.5, 1)] == [1.0, 1.0, 1.0]
    assert [lr_factor("linear", p, 0.2) for p in (0, 0.5, 1)] == pytest.approx([1.0, 0.6, 0.2])
    assert [lr_factor("cosine", p) for p in (0, 0.5, 1)] == pytest.approx([1.0, 0.5, 0.0])
    assert lr_factor("cosine", 0.25, 0.1) == pytest.approx(
        0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2
    )
    assert lr_factor("linear", 1.7) == 0.0  # progress past the end is clamped
    with pytest.raises(ValueError, match="lr_schedule"):
        lr_factor("step", 0.5)


def test_progress_is_towards_whichever_limit_comes_first():
    assert run_progress(10, 100, 0.0, 0.0) == pytest.approx(0.1)
    assert run_progress(10, 100, 540.0, 30.0) == pytest.approx(0.3)  # 9 of 30 minutes
    assert run_progress(90, 100, 540.0, 30.0) == pytest.approx(0.9)
    assert run_progress(5, 0, 0.0, 0.0) == 0.0  # no limit: the schedule stays at its start
    assert run_progress(500, 100, 0.0, 0.0) == 1.0


def test_warmup_rises_linearly_over_its_steps_then_stays_at_one():
    assert [warmup_factor(s, 4) for s in range(6)] == pytest.approx([0.25, 0.5, 0.75, 1, 1, 1])
    assert warmup_factor(0, 0) == 1.0  # no warm-up
    assert warmup_factor(0, 1) == 1.0  # one step of warm-up is the full rate


def test_config_names_a_bad_schedule(tmp_path):
    base = ["model.path=unused", "data.prompts=unused.jsonl"]
    load_config(None, [*base, "train.lr_schedule=cosine", "train.lr_min_ratio=0.1"])
    with pytest.raises(ConfigError, match=r"train\.lr_schedule.*'exp'"):
        load_config(None, [*base, "train.lr_schedule=exp"])
    with pytest.raises(ConfigError, match=r"train\.lr_min_ratio"):
        load_config(None, [*base, "train.lr_min_ratio=1.5"])
    with pytest.raises(ConfigError, match=r"train\.lr_warmup_steps.*-3"):
        load_config(None, [*base, "train.lr_warmup_steps=-3"])
