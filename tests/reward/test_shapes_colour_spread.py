"""``shapes_colour_spread``: a group-relative bonus for a colour the rest of the group draws
rarely, where the prompt names no colour; nothing where it names one."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from omnirl.protocol.messages import DiffusionTrajectoryGroup, PromptSpec, SamplingParams
from omnirl.reward.scoring import parse_scorer_spec, score_groups
from omnirl.reward.shapes import ShapeSpec
from omnirl.reward.shapes.render import render


def _renders(spec: ShapeSpec, colours: list[str]) -> np.ndarray:
    """One render of ``spec`` per entry of ``colours``, its objects in that colour."""
    images = []
    for k, colour in enumerate(colours):
        objects = tuple(dataclasses.replace(o, colour=colour) for o in spec.objects)
        images.append(render(dataclasses.replace(spec, objects=objects), 32, seed=k))
    return np.stack(images)


def _group(gid: str, text: str, images: np.ndarray) -> DiffusionTrajectoryGroup:
    g = len(images)
    return DiffusionTrajectoryGroup(
        group_id=gid,
        lease_id="L",
        worker_id="w",
        prompt=PromptSpec(group_id=gid, text=text),
        sampling=SamplingParams(group_size=g, height=32, width=32),
        policy_version=0,
        seeds=torch.arange(g),
        images=torch.from_numpy(images),
    )


def test_the_rarer_colour_in_a_group_earns_more_and_named_colours_earn_nothing():
    free = ShapeSpec.from_text("a photo of two circles")
    named = ShapeSpec.from_text("a photo of a blue square")
    colours = ["red", "red", "red", "red", "yellow", "cyan"]
    groups = [
        _group("e0:0", free.text, _renders(free, colours)),
        _group("e0:1", named.text, _renders(named, ["blue"] * 6)),
        _group("e0:2", free.text, _renders(free, ["green"] * 6)),
    ]
    scorers = parse_scorer_spec("shapes_eval,shapes_colour_spread:0.1")
    results = score_groups(groups, scorers, scorer_id="r")
    spread = [r.components["shapes_colour_spread.spread"] for r in results]
    # four reds of six: 1 - 4/6; the yellow and the cyan are alone: 1 - 1/6
    assert spread[0] == pytest.approx([1 / 3] * 4 + [5 / 6] * 2)
    assert spread[1] == [0.0] * 6  # the prompt names the colour
    assert spread[2] == [0.0] * 6  # one colour for the whole group
    for r in results:  # the renders pass; the total is partial + 0.1 x spread
        assert r.components["shapes_eval.strict"] == [1.0] * 6
        parts = r.components["shapes_eval.partial"], r.components["shapes_colour_spread.spread"]
        expected = [p + 0.1 * s for p, s in zip(*parts, strict=True)]
        assert r.total == pytest.approx(expected)
