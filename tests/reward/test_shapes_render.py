"""ShapesEval renderer: deterministic, plain background, objects inside and apart."""

import numpy as np
import pytest

from omnirl.reward.shapes.render import layout, render, render_batch
from omnirl.reward.shapes.world import BACKGROUND, CATEGORIES, PALETTE, generate_prompts


@pytest.mark.parametrize("size", [32, 64])
def test_render_is_deterministic_in_the_seed(size):
    specs = generate_prompts(60, "train", seed=1)
    for i, spec in enumerate(specs):
        a = render(spec, size, seed=i)
        assert a.dtype == np.uint8 and a.shape == (size, size, 3)
        assert np.array_equal(a, render(spec, size, seed=i))
    differ = sum(not np.array_equal(render(s, size, 0), render(s, size, 1)) for s in specs)
    assert differ == len(specs)


def test_background_is_plain_and_colours_are_the_palette():
    palette = {tuple(c) for c in PALETTE.values()}
    for i, spec in enumerate(generate_prompts(60, "heldout", seed=2)):
        image = render(spec, 32, seed=i, antialias=False)
        colours = {tuple(p) for p in image.reshape(-1, 3)}
        assert tuple(BACKGROUND) in colours
        assert colours - {tuple(BACKGROUND)} <= palette
        border = np.concatenate([image[0], image[-1], image[:, 0], image[:, -1]])
        assert (border == BACKGROUND).all()  # objects stay inside the frame
        wanted = {o.colour for o in spec.objects if o.colour}
        assert wanted <= {name for name, c in PALETTE.items() if tuple(c) in colours}


def test_layout_keeps_objects_apart_and_counts_right():
    rng = np.random.default_rng(0)
    for spec in generate_prompts(300, "train", seed=5):
        placed = layout(spec, 32, rng)
        assert len(placed) == sum(o.count for o in spec.objects)
        for a in placed:
            assert a.s / 2 <= a.cx <= 32 - a.s / 2 and a.s / 2 <= a.cy <= 32 - a.s / 2
        for i, a in enumerate(placed):
            for b in placed[i + 1 :]:
                reach = (a.s + b.s) / 2
                assert abs(a.cx - b.cx) >= reach or abs(a.cy - b.cy) >= reach


def test_render_batch_matches_render():
    specs = [s for c in CATEGORIES for s in generate_prompts(20, "train", seed=0, categories=(c,))]
    batch = render_batch(specs, 32)
    assert batch.shape == (len(specs), 32, 32, 3)
    assert all(np.array_equal(batch[i], render(s, 32, i)) for i, s in enumerate(specs))


def test_bad_size_is_refused():
    with pytest.raises(ValueError, match="size"):
        render(generate_prompts(1, "train")[0], 16)
