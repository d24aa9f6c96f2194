"""shapes_preferences writes preference files the trainer reads: render mode (correct render vs
a render of a spec one change away, scored lower) and sample mode (best vs worst of a model's
group by the detector)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from omnirl.reward.shapes import ShapeSpec, score_batch
from omnirl.tools.shapes_preferences import main, wrong_specs
from omnirl.trainer.preferences import read_preference_file

BASE = Path(__file__).resolve().parents[2] / "examples" / "checkpoints" / "shapes_t2i"


def _differences(a: ShapeSpec, b: ShapeSpec) -> int:
    objs = sum(x != y for x, y in zip(a.objects, b.objects, strict=True))
    return objs + (a.relation != b.relation)


@pytest.mark.parametrize(
    "text",
    [
        "a photo of a red circle",
        "a photo of three triangles",
        "a photo of a yellow square left of a blue circle",
        "a photo of a circle and a square",
    ],
)
def test_wrong_specs_are_valid_and_one_change_away(text):
    spec = ShapeSpec.from_text(text)
    wrong = wrong_specs(spec)
    assert wrong and spec not in wrong
    assert all(w.category == spec.category and _differences(spec, w) == 1 for w in wrong)
    if spec.relation:
        assert any(w.relation == "right of" for w in wrong)


def _read(out):
    file = read_preference_file(out / "preferences.jsonl")
    rows = [json.loads(x) for x in (out / "preferences.jsonl").read_text().splitlines()[1:]]
    return file, rows


def test_render_mode_pairs_a_strict_image_with_a_worse_one(tmp_path):
    out = tmp_path / "prefs"
    assert main([str(out), "--n", "12", "--mode", "render"]) == 0
    file, rows = _read(out)
    assert file.metadata["mode"] == "render" and file.metadata["pairs"] == len(file.pairs) == 12
    for pair, row in zip(file.pairs, rows, strict=True):
        spec = ShapeSpec.from_metadata(pair.metadata)
        images = np.stack([np.asarray(Image.open(p)) for p in (pair.chosen, pair.rejected)])
        good, bad = score_batch(images, spec)
        assert good.strict and not bad.strict and bad.partial < good.partial
        assert row["scores"]["chosen"] == pytest.approx(good.partial, abs=1e-4)


def test_sample_mode_takes_best_and_worst_of_the_models_group(tmp_path):
    # the committed base model: a random one draws noise, which scores 0 everywhere (all ties)
    out = tmp_path / "sampled"
    argv = [str(out), "--n", "4", "--mode", "sample", "--model", str(BASE)]
    assert main([*argv, "--group", "3", "--steps", "4", "--threads", "1"]) == 0
    file, rows = _read(out)
    assert file.metadata["pairs"] >= 1 and file.metadata["pairs"] + file.metadata["skipped"] == 4
    for pair, row in zip(file.pairs, rows, strict=True):
        spec = ShapeSpec.from_metadata(pair.metadata)
        images = np.stack([np.asarray(Image.open(p)) for p in (pair.chosen, pair.rejected)])
        good, bad = score_batch(images, spec)
        assert row["scores"]["chosen"] > row["scores"]["rejected"]
        assert good.partial == pytest.approx(row["scores"]["chosen"], abs=1e-4)
        assert bad.partial == pytest.approx(row["scores"]["rejected"], abs=1e-4)


def test_sample_mode_needs_a_model(tmp_path):
    assert main([str(tmp_path), "--mode", "sample"]) == 2
