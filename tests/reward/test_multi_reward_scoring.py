"""Scoring several groups at once: batching, concurrency, per-group refusals, weights."""

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from omnirl.protocol.messages import DiffusionTrajectoryGroup, PromptSpec, SamplingParams
from omnirl.reward.scorers import ScoreBatch, register_reward
from omnirl.reward.scorers.jpeg import jpeg_sizes_kb
from omnirl.reward.scoring import ScoringError, parse_scorer_spec, score_group, score_groups

CALLS: list[tuple[int, str]] = []  # (batch size, thread name) of each mean-pixel call


@register_reward("test_multi_mean_pixel")
class MeanPixel:
    """Component ``mean``: the image's mean pixel; NaN for prompts containing 'nan'."""

    components = ("mean", "minus")
    reads = frozenset({"images", "prompt"})
    batchable = True
    thread_safe = True

    def __call__(self, batch: ScoreBatch):
        CALLS.append((len(batch), threading.current_thread().name))
        if any("boom" in p for p in batch.prompts):
            raise RuntimeError("kaboom")
        mean = batch.images.reshape(len(batch), -1).mean(axis=1)
        mean = np.where(["nan" in p for p in batch.prompts], np.nan, mean)
        return {"mean": mean, "minus": -mean}


@register_reward("test_multi_no_images")
class PromptLength:
    components = ("test_multi_no_images",)
    reads = frozenset({"prompt", "metadata"})
    batchable = False
    thread_safe = False

    def __call__(self, batch: ScoreBatch):
        assert batch.images is None  # not handed what it did not declare
        return {
            "test_multi_no_images": [
                float(len(p) + m.get("bonus", 0))
                for p, m in zip(batch.prompts, batch.metadata, strict=True)
            ]
        }


def make_group(i: int, prompt: str, g: int = 3, size: int = 16) -> DiffusionTrajectoryGroup:
    rng = np.random.default_rng(i)
    return DiffusionTrajectoryGroup(
        group_id=f"g{i}",
        lease_id="l",
        worker_id="w",
        prompt=PromptSpec(group_id=f"g{i}", text=prompt, metadata={"bonus": i}),
        sampling=SamplingParams(group_size=g),
        policy_version=0,
        seeds=torch.arange(g),
        images=torch.from_numpy(rng.integers(0, 256, (g, size, size, 3), dtype=np.uint8)),
    )


def test_weighted_total_and_every_component_logged():
    group = make_group(0, "a cat")
    scorers = parse_scorer_spec(
        "test_multi_mean_pixel.mean:2,test_multi_no_images:0.5,jpeg_incompressibility:1"
    )
    rewards = score_group(group, scorers, scorer_id="r0")
    mean = group.images.numpy().reshape(3, -1).mean(axis=1)
    assert rewards.components["test_multi_mean_pixel.mean"] == pytest.approx(mean)
    assert rewards.components["test_multi_mean_pixel.minus"] == pytest.approx(-mean)
    assert rewards.components["test_multi_no_images"] == [5.0] * 3
    assert rewards.weights == {
        "test_multi_mean_pixel.mean": 2.0,
        "test_multi_mean_pixel.minus": 0.0,
        "test_multi_no_images": 0.5,
        "jpeg_incompressibility": 1.0,
    }
    expected = 2 * mean + 2.5 + np.array(jpeg_sizes_kb(group.images))
    assert rewards.total == pytest.approx(expected)


def test_groups_are_batched_into_one_call_and_split_across_a_pool():
    groups = [make_group(i, f"prompt {i}") for i in range(6)]
    scorers = parse_scorer_spec("test_multi_mean_pixel")
    CALLS.clear()
    serial = score_groups(groups, scorers, scorer_id="r")
    assert [n for n, _ in CALLS] == [18]  # 6 groups x 3 images, one call
    CALLS.clear()
    with ThreadPoolExecutor(3, thread_name_prefix="score") as pool:
        pooled = score_groups(groups, scorers, scorer_id="r", pool=pool, workers=3)
    assert sorted(n for n, _ in CALLS) == [6, 6, 6]
    assert all(name.startswith("score") for _, name in CALLS)
    assert [r.total for r in pooled] == [r.total for r in serial]
    assert [r.group_id for r in pooled] == [f"g{i}" for i in range(6)]


def test_groups_of_different_image_sizes_are_not_concatenated():
    groups = [make_group(0, "a"), make_group(1, "b", size=8), make_group(2, "c", size=8)]
    CALLS.clear()
    results = score_groups(groups, parse_scorer_spec("test_multi_mean_pixel"), scorer_id="r")
    assert [n for n, _ in CALLS] == [3, 6]
    assert all(not isinstance(r, ScoringError) for r in results)


def test_nan_refuses_only_its_group_never_a_silent_zero():
    groups = [make_group(0, "fine"), make_group(1, "a nan here"), make_group(2, "fine too")]
    results = score_groups(groups, parse_scorer_spec("test_multi_mean_pixel"), scorer_id="r")
    assert isinstance(results[1], ScoringError)
    assert "g1" in str(results[1]) and "non-finite" in str(results[1])
    assert "test_multi_mean_pixel" in str(results[1])
    assert not isinstance(results[0], ScoringError) and not isinstance(results[2], ScoringError)


def test_an_exception_in_a_batch_is_traced_to_its_group():
    groups = [make_group(0, "ok"), make_group(1, "boom"), make_group(2, "ok")]
    results = score_groups(groups, parse_scorer_spec("test_multi_mean_pixel"), scorer_id="r")
    assert isinstance(results[1], ScoringError) and "kaboom" in str(results[1])
    assert [isinstance(r, ScoringError) for r in results] == [False, True, False]
    with pytest.raises(ScoringError, match=r"g1.*RuntimeError: kaboom"):
        score_group(groups[1], parse_scorer_spec("test_multi_mean_pixel"), scorer_id="r")


def test_a_group_without_images_is_refused_with_a_reason():
    group = make_group(0, "x")
    group.images = None
    with pytest.raises(ScoringError, match="no images"):
        score_group(group, parse_scorer_spec("jpeg_compressibility"), scorer_id="r")
    # a reward that reads only the prompt does not need them
    rewards = score_group(group, parse_scorer_spec("test_multi_no_images"), scorer_id="r")
    assert rewards.total == [1.0, 1.0, 1.0]
