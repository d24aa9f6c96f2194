"""``benchmarks/shapes_clutter_rule.py``: the prototype rule leaves out specks touching an
object, and only those."""

from __future__ import annotations

import numpy as np
import pytest

from omnirl.reward.shapes.detector import score_batch
from omnirl.reward.shapes.render import render
from omnirl.reward.shapes.world import PALETTE, ShapeObject, ShapeSpec


def test_specks_touching_an_object_are_not_clutter_and_far_ones_still_are(benchmark_script):
    rule = benchmark_script("shapes_clutter_rule").score_batch_edge_specks
    spec = ShapeSpec("single_object", (ShapeObject(1, None, "square"),))
    image = render(ShapeSpec("single_object", (ShapeObject(1, "red", "square"),)), 32, seed=0)
    assert score_batch(image[None], spec)[0].details["clutter"] == 0.0
    ys, xs = np.nonzero((image != image[0, 0]).any(-1))  # the square's pixels
    y, x = ys.min(), xs.max() + 1  # just right of its top-right corner
    image[y : y + 2, x : x + 1] = PALETTE["blue"]  # a 2-pixel speck touching it
    far = image.copy()
    far[30:32, 0:1] = PALETTE["blue"]  # and one in a far corner
    old, new = score_batch(far[None], spec)[0], rule(far[None], spec)[0]
    assert old.details["clutter"] == pytest.approx(4 / 1024, abs=1e-4)  # rounded to 4 places
    assert new.details["clutter"] == pytest.approx(2 / 1024, abs=1e-4)  # only the far one
    assert rule(image[None], spec)[0].details["clutter"] == 0.0


def test_extras_touching_another_object_are_told_from_extras_apart(benchmark_script):
    from omnirl.reward.shapes.detector import ShapeScore

    extras = benchmark_script("shapes_clutter_rule").extras
    objects = [
        {"colour": "green", "shape": "circle", "bbox": [4, 4, 12, 12], "area": 60},
        {"colour": "unknown", "shape": "unknown", "bbox": [13, 6, 15, 10], "area": 9},  # beside
        {"colour": "red", "shape": "square", "bbox": [24, 24, 30, 30], "area": 40},  # apart
    ]
    result = ShapeScore(0.4, False, {"objects": objects, "extras": [1, 2]})
    assert extras(result) == (1, 1)
    assert extras(ShapeScore(1.0, True, {"objects": objects[:1], "extras": []})) == (0, 0)
