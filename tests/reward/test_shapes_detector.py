"""ShapesEval detector on correct renders: clean, noisy, slightly blurred; batch API."""

import numpy as np
import pytest
import torch

from omnirl.reward.shapes.detector import ShapeImageError, score, score_batch
from omnirl.reward.shapes.measure import blur, gaussian_noise
from omnirl.reward.shapes.render import render
from omnirl.reward.shapes.world import CATEGORIES, COLOURS, ShapeSpecError, generate_prompts


def _specs(per_category: int, seed: int) -> list:
    out = []
    for category in CATEGORIES:
        for split in ("train", "heldout"):
            out += generate_prompts(per_category // 2, split, seed=seed, categories=(category,))
    return out


def _strict_rate(
    specs, size, transform=lambda image, i: image, group=4, merge_parts=False
) -> dict[str, float]:
    passed: dict[str, list[bool]] = {c: [] for c in CATEGORIES}
    for i, spec in enumerate(specs):
        images = np.stack(
            [transform(render(spec, size, 100 * i + k), 100 * i + k) for k in range(group)]
        )
        results = score_batch(images, spec, merge_parts=merge_parts)
        passed[spec.category] += [r.strict and r.partial == 1.0 for r in results]
    return {c: float(np.mean(v)) for c, v in passed.items()}


@pytest.mark.parametrize("merge_parts", [False, True])
@pytest.mark.parametrize("size,per_category", [(32, 16), (64, 6)])
def test_correct_renders_pass_in_every_category(size, per_category, merge_parts):
    specs = _specs(per_category, seed=size)  # 384 images at 32, 144 at 64
    rates = _strict_rate(specs, size, merge_parts=merge_parts)
    assert min(rates.values()) >= 0.98, rates


@pytest.mark.parametrize("merge_parts", [False, True])
@pytest.mark.parametrize("sigma", [4.0, 8.0])
def test_small_gaussian_noise_still_passes(sigma, merge_parts):
    noisy = lambda im, i: gaussian_noise(im, sigma, i)  # noqa: E731
    rates = _strict_rate(_specs(8, seed=7), 32, noisy, merge_parts=merge_parts)
    assert min(rates.values()) >= 0.9 and np.mean(list(rates.values())) >= 0.97, rates


def test_slight_blur_still_passes():
    rates = _strict_rate(_specs(8, seed=8), 32, lambda im, i: blur(im))
    assert min(rates.values()) >= 0.9 and np.mean(list(rates.values())) >= 0.97, rates


def test_batch_equals_single_and_torch_input_is_accepted():
    spec = generate_prompts(1, "train", seed=0, categories=("position",))[0]
    images = np.stack([render(spec, 32, k) for k in range(5)])
    batch = score_batch(torch.from_numpy(images), spec.to_metadata())
    for k in range(5):
        one = score(images[k], spec)
        assert (one.partial, one.strict, one.details) == (
            batch[k].partial,
            batch[k].strict,
            batch[k].details,
        )


def test_details_name_what_was_seen():
    spec = generate_prompts(1, "train", seed=0, categories=("color_attr",))[0]
    result = score(render(spec, 32, 0), spec)
    seen = {(o["colour"], o["shape"]) for o in result.details["objects"]}
    assert seen == {(o.colour, o.shape) for o in spec.objects}
    assert result.details["reasons"] == [] and result.details["extras"] == []


@pytest.mark.parametrize(
    "images",
    [
        np.zeros((2, 32, 32, 3), dtype=np.float32),
        np.zeros((32, 32, 3), dtype=np.uint8),
        np.zeros((2, 32, 32, 4), dtype=np.uint8),
        [[1, 2, 3]],
    ],
)
def test_bad_images_are_a_typed_error(images):
    spec = generate_prompts(1, "train")[0]
    with pytest.raises(ShapeImageError):
        score_batch(images, spec)


def test_bad_spec_is_a_typed_error():
    with pytest.raises(ShapeSpecError):
        score_batch(np.zeros((1, 32, 32, 3), dtype=np.uint8), {"category": "colors"})


def test_blank_and_empty_images_score_zero():
    spec = generate_prompts(1, "train", categories=("colors",))[0]
    blank = np.full((2, 32, 32, 3), 240, dtype=np.uint8)
    for result in score_batch(blank, spec):
        assert result.partial == 0.0 and not result.strict


def test_measure_by_colour_scores_every_colour_against_a_prompt_naming_none(capsys):
    from omnirl.reward.shapes.measure import CONDITIONS, colour_rates, main

    clean = colour_rates(32, CONDITIONS["clean"], seeds=1)
    assert set(clean) == set(COLOURS)
    assert all(partial == 1.0 and strict == 1.0 for partial, strict in clean.values())
    noisy = colour_rates(32, CONDITIONS["noise30"], seeds=1)
    assert all(partial < 0.5 for partial, _ in noisy.values())  # the table can tell them apart
    assert main(["--by-colour", "--group", "1", "--sizes", "32", "--conditions", "clean"]) == 0
    out = capsys.readouterr().out
    assert all(f"{c:>8}    1.000 / 1.00" in out for c in COLOURS)
