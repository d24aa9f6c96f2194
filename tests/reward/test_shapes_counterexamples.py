"""ShapesEval detector on wrong images: every one fails strict and loses partial credit, with
and without ``merge_parts``."""

import dataclasses

import numpy as np
import pytest

from omnirl.reward.shapes.detector import score
from omnirl.reward.shapes.render import render
from omnirl.reward.shapes.world import (
    BACKGROUND,
    CATEGORIES,
    COLOURS,
    PALETTE,
    SHAPES,
    ShapeObject,
    ShapeSpec,
    generate_prompts,
)

OPPOSITE = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}


def _specs(categories=CATEGORIES, n=36, seed=0):
    return generate_prompts(n, "train", seed=seed, categories=categories) + generate_prompts(
        n // 2, "heldout", seed=seed, categories=categories
    )


def _assert_wrong(image, spec, max_partial=0.9):
    """Both rules fail ``image``; returns the default rule's result."""
    for merge_parts in (True, False):
        result = score(image, spec, merge_parts=merge_parts)
        assert not result.strict, (spec.text, merge_parts, result.details)
        assert result.partial <= max_partial, (spec.text, merge_parts, result.partial)
    return result


def _replace(spec: ShapeSpec, g: int, **change) -> ShapeSpec:
    objects = list(spec.objects)
    objects[g] = dataclasses.replace(objects[g], **change)
    return ShapeSpec(spec.category, tuple(objects), spec.relation)


def _free_spot(image: np.ndarray, side: int, rng) -> tuple[int, int]:
    """Top-left corner of a ``side`` square of background with a 2-pixel free margin."""
    h, w, _ = image.shape
    bg = (image == BACKGROUND).all(-1)
    spots = [
        (y, x)
        for y in range(2, h - side - 2)
        for x in range(2, w - side - 2)
        if bg[y - 2 : y + side + 2, x - 2 : x + side + 2].all()
    ]
    return spots[rng.integers(len(spots))]


def test_wrong_colour():
    for i, spec in enumerate(_specs(("colors", "position", "color_attr"))):
        used = {o.colour for o in spec.objects}
        other = next(c for c in COLOURS if c not in used)
        _assert_wrong(
            render(_replace(spec, i % len(spec.objects), colour=other), 32, i), spec, 0.85
        )


def test_swapped_colour_binding():
    for i, spec in enumerate(_specs(("color_attr",))):
        a, b = spec.objects
        swapped = ShapeSpec(
            "color_attr",
            (dataclasses.replace(a, colour=b.colour), dataclasses.replace(b, colour=a.colour)),
        )
        _assert_wrong(render(swapped, 32, i), spec, 0.5)


def test_wrong_shape():
    for i, spec in enumerate(_specs()):
        used = {o.shape for o in spec.objects}
        other = next(s for s in SHAPES if s not in used)
        _assert_wrong(render(_replace(spec, i % len(spec.objects), shape=other), 32, i), spec, 0.85)


def test_wrong_count():
    for i, spec in enumerate(_specs(("counting",))):
        n = spec.objects[0].count
        for wrong in {max(1, n - 1), min(4, n + 1)} - {n}:
            _assert_wrong(render(_replace(spec, 0, count=wrong), 32, i), spec, 0.8)


def test_wrong_relation():
    for i, spec in enumerate(_specs(("position",))):
        flipped = ShapeSpec("position", spec.objects, OPPOSITE[spec.relation])
        result = _assert_wrong(render(flipped, 32, i), spec, 0.67)
        assert result.details["relation_ok"] is False


@pytest.mark.parametrize("colour", [*COLOURS, "brown"])
def test_extra_stray_blob(colour):
    rgb = PALETTE.get(colour, (120, 70, 20))
    rng = np.random.default_rng(len(colour))
    for i, spec in enumerate(_specs(n=12, seed=len(colour))):
        image = render(spec, 32, i).copy()
        y, x = _free_spot(image, 3, rng)
        image[y : y + 3, x : x + 3] = rgb  # 9 pixels: small, but no speck
        result = _assert_wrong(image, spec)
        assert len(result.details["extras"]) >= 1


def test_extra_object_of_another_colour():
    for i, spec in enumerate(_specs(("single_object", "colors", "counting"))):
        want = spec.objects[0]
        colour = next(c for c in COLOURS if c != want.colour)
        shape = next(s for s in SHAPES if s != want.shape)
        # the wanted objects plus one more: the same scene as a two-group spec
        scene = ShapeSpec("two_object", (want, ShapeObject(1, colour, shape)))
        _assert_wrong(render(scene, 32, i), spec, 0.8)


def test_extra_object_of_the_same_kind():
    for i, spec in enumerate(_specs(("single_object", "colors"))):
        _assert_wrong(render(_replace(spec, 0, count=2), 32, i), spec, 0.5)


def _background(image):
    return (image == BACKGROUND).all(-1)


def test_noisy_background():
    rng = np.random.default_rng(0)
    for i, spec in enumerate(_specs(n=18)):
        image = render(spec, 32, i).astype(np.float32)
        bg = _background(image.astype(np.uint8))
        image[bg] += rng.normal(0, 40, (int(bg.sum()), 3))
        _assert_wrong(np.clip(image, 0, 255).astype(np.uint8), spec, 0.5)


def test_faint_striped_background():
    for i, spec in enumerate(_specs(n=18)):
        image = render(spec, 32, i).astype(np.float32)
        tint = np.asarray(PALETTE[COLOURS[i % len(COLOURS)]], dtype=np.float32)
        stripes = _background(image.astype(np.uint8)) & ((np.arange(32) // 2) % 2 == 0)[None, :]
        image[stripes] += 0.4 * (tint - image[stripes])  # below the half-coverage threshold
        _assert_wrong(np.rint(image).astype(np.uint8), spec, 0.8)


def test_speckled_background():
    rng = np.random.default_rng(1)
    for i, spec in enumerate(_specs(n=18)):
        image = render(spec, 32, i).copy()
        ys, xs = np.nonzero(_background(image))
        pick = rng.choice(len(ys), size=int(0.04 * 32 * 32), replace=False)
        image[ys[pick], xs[pick]] = np.asarray(list(PALETTE.values()))[
            rng.integers(6, size=len(pick))
        ]
        _assert_wrong(image, spec, 0.8)


def test_partial_credit_orders_near_misses():
    spec = generate_prompts(1, "train", seed=2, categories=("counting",))[0]
    n = spec.objects[0].count
    right = score(render(spec, 32, 0), spec).partial
    off_by_one = score(render(_replace(spec, 0, count=n - 1 if n > 1 else 2), 32, 0), spec).partial
    nothing = score(np.full((32, 32, 3), 240, np.uint8), spec).partial
    assert right == 1.0 > off_by_one > nothing == 0.0


def test_tiny_objects_do_not_count():
    """Four 3 x 3 dots are not "four squares": too small to have a shape, so extras."""
    for n_seed in range(6):
        rng = np.random.default_rng(n_seed)
        spec = ShapeSpec("counting", (ShapeObject(4, None, "square"),))
        image = np.full((32, 32, 3), BACKGROUND, dtype=np.uint8)
        for _ in range(4):
            y, x = _free_spot(image, 3, rng)
            image[y : y + 3, x : x + 3] = PALETTE[COLOURS[int(rng.integers(6))]]
        result = _assert_wrong(image, spec, 0.0)
        assert {o["shape"] for o in result.details["objects"]} == {"unknown"}
