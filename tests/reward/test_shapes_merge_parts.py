"""The detector's ``merge_parts``: a part of no palette colour touching a palette object is
part of that object (a shape drawn partly in a shade off the palette line), never the
reverse, and an off-palette object standing apart stays an extra."""

import numpy as np
import pytest

from omnirl.reward.scorers.registry import RewardOptionError, ScoreBatch
from omnirl.reward.scoring import parse_scorer_spec
from omnirl.reward.shapes.detector import score
from omnirl.reward.shapes.world import BACKGROUND, COLOURS, PALETTE, ShapeObject, ShapeSpec

BROWN = (120, 70, 20)  # no palette colour


def _canvas() -> np.ndarray:
    return np.full((32, 32, 3), BACKGROUND, dtype=np.uint8)


def _half_shaded_square(colour: str) -> np.ndarray:
    """A 12 x 12 square of ``colour`` whose right third is a darker shade (off the line
    from the background to the palette colour, as a model's darker colours come out)."""
    image = _canvas()
    image[10:22, 8:20] = PALETTE[colour]
    image[10:22, 16:20] = (np.asarray(PALETTE[colour]) * 0.35).astype(np.uint8)
    return image


@pytest.mark.parametrize("colour", COLOURS)
def test_a_shape_with_an_off_palette_shade_is_one_object(colour):
    spec = ShapeSpec("colors", (ShapeObject(1, colour, "square"),))
    image = _half_shaded_square(colour)
    cut = score(image, spec)
    assert [o["colour"] for o in cut.details["objects"]].count("unknown") == 1, cut.details
    assert not cut.strict and cut.details["extras"]
    merged = score(image, spec, merge_parts=True)
    assert merged.strict and merged.partial == 1.0, merged.details
    (obj,) = merged.details["objects"]
    assert (obj["colour"], obj["shape"], obj["bbox"]) == (colour, "square", [8, 10, 19, 21])


def test_a_dot_of_colour_does_not_make_a_blot_of_no_colour_an_object_of_that_colour():
    spec = ShapeSpec("colors", (ShapeObject(1, "red", "square"),))
    image = _canvas()
    image[8:20, 8:20] = BROWN  # 144 pixels of no palette colour
    image[12:16, 20:24] = PALETTE["red"]  # 16 red pixels touching it
    cut, merged = score(image, spec), score(image, spec, merge_parts=True)
    assert not merged.strict and merged.partial == cut.partial
    assert merged.details["objects"] == cut.details["objects"]
    assert {o["colour"] for o in merged.details["objects"]} == {"red", "unknown"}


def test_an_off_palette_object_standing_apart_stays_an_extra():
    spec = ShapeSpec("colors", (ShapeObject(1, "blue", "square"),))
    image = _canvas()
    image[4:14, 4:14] = PALETTE["blue"]
    image[20:28, 20:28] = BROWN  # apart: no pixel within one of the square
    merged = score(image, spec, merge_parts=True)
    assert not merged.strict and len(merged.details["extras"]) == 1
    assert merged.details == score(image, spec).details


def test_the_reward_takes_merge_parts_as_an_option():
    spec = ShapeSpec("colors", (ShapeObject(1, "green", "square"),))
    images = np.stack([_half_shaded_square("green")] * 2)
    batch = ScoreBatch(images, [spec.text] * 2, [spec.to_metadata()] * 2)
    (plain,) = parse_scorer_spec("shapes_eval")
    (merged,) = parse_scorer_spec("shapes_eval(merge_parts=true)")
    assert plain.reward(batch)["strict"] == [0.0, 0.0]
    assert merged.reward(batch) == {"partial": [1.0, 1.0], "strict": [1.0, 1.0]}
    with pytest.raises(RewardOptionError, match="merge_parts"):
        parse_scorer_spec("shapes_eval(merge_parts=2)")
