"""Caption noise for ShapesEval pretraining: each mislabelled image differs from its caption
by exactly one error of a kind that fits the category, and the detector sees it."""

import numpy as np
import pytest

from omnirl.reward.shapes import CATEGORIES, render, score_batch
from omnirl.reward.shapes.world import specs_in_split
from omnirl.tools.shapes_caption_noise import ERROR_KINDS, drawn_specs, mislabel


def _n_objects(spec):
    return sum(o.count for o in spec.objects)


@pytest.mark.parametrize("category", CATEGORIES)
def test_every_error_kind_changes_the_image_in_its_documented_way(category):
    rng = np.random.default_rng(0)
    seen = set()
    for spec in specs_in_split(category, "train")[:40]:
        for _ in range(6):
            drawn, kind = mislabel(spec, rng)
            seen.add(kind)
            assert drawn != spec
            if kind == "extra":
                assert _n_objects(drawn) == _n_objects(spec) + 1
            elif kind == "missing":
                assert _n_objects(drawn) == 1 and drawn.objects[0] in spec.objects
            elif kind == "miscount":
                assert abs(drawn.objects[0].count - spec.objects[0].count) == 1
                assert 1 <= drawn.objects[0].count <= 4
            elif kind == "relation":
                assert drawn.objects == spec.objects and drawn.relation != spec.relation
            elif kind == "colour":
                assert [o.shape for o in drawn.objects] == [o.shape for o in spec.objects]
                assert [o.colour for o in drawn.objects] != [o.colour for o in spec.objects]
    assert seen == set(ERROR_KINDS[category])


def test_a_mislabelled_render_fails_the_captions_strict_check():
    rng = np.random.default_rng(1)
    specs = [s for c in CATEGORIES for s in specs_in_split(c, "train")[:20]]
    failed = 0
    for i, spec in enumerate(specs):
        drawn, _ = mislabel(spec, rng)
        image = render(drawn, size=32, seed=i)[None]
        assert score_batch(render(spec, size=32, seed=i)[None], spec)[0].strict
        failed += not score_batch(image, spec)[0].strict
    assert failed == len(specs)  # every error kind is one the strict check catches


def test_drawn_specs_mislabel_at_the_given_rate_and_keep_the_rest():
    rng = np.random.default_rng(2)
    specs = [s for c in CATEGORIES for s in specs_in_split(c, "train")[:3]] * 300
    drawn = drawn_specs(specs, 0.3, rng)
    changed = np.mean([d != s for d, s in zip(drawn, specs, strict=True)])
    assert 0.27 < changed < 0.33
    assert drawn_specs(specs, 0.0, rng) == specs
    with pytest.raises(ValueError, match="caption noise rate"):
        drawn_specs(specs, 1.5, rng)


def test_kinds_restrict_the_errors_and_unknown_kinds_are_refused():
    rng = np.random.default_rng(3)
    structural = ("extra", "missing", "miscount")
    for category in CATEGORIES:
        for spec in specs_in_split(category, "train")[:20]:
            drawn, kind = mislabel(spec, rng, structural)
            assert kind in structural and drawn != spec  # every category has one that fits
            bindings = {o.shape: o.colour for o in spec.objects}  # shapes of a spec differ
            assert all(bindings.get(o.shape, o.colour) == o.colour for o in drawn.objects)
            assert drawn.relation in (spec.relation, None)
    colour_only = [s for s in specs_in_split("counting", "train")]  # counting has no colour error
    assert mislabel(colour_only[0], rng, ("colour",)) == (colour_only[0], "none")
    with pytest.raises(ValueError, match="error kinds"):
        drawn_specs(colour_only, 0.5, rng, ("colour", "typo"))
    with pytest.raises(ValueError, match="error kinds"):
        drawn_specs(colour_only, 0.5, rng, ())
