"""The ShapesEval detector as a reward (``shapes_eval``): partial credit for training, strict
pass / fail as a second component for the metric.

Components: ``partial`` (primary, in [0, 1]) and ``strict`` (1.0 or 0.0). Option
``merge_parts`` (``shapes_eval(merge_parts=true)``): a part of no palette colour touching a
palette object is part of it, not an extra (the detector's ``merge_parts``). The spec of each
sample comes from its prompt metadata (``ShapeSpec.from_metadata``) when that carries a
ShapesEval spec, else from its text (``ShapeSpec.from_text``). Limitation of the text path:
only prompts of the ShapesEval grammar parse (anything else raises ``ShapeSpecError``, a
``ValueError``, which refuses the group rather than scoring it 0).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omnirl.reward.scorers.jpeg import as_uint8_batch
from omnirl.reward.scorers.registry import RewardOptionError, ScoreBatch, register_reward
from omnirl.reward.shapes import ShapeSpec, score_batch
from omnirl.reward.shapes.detector import dominant_colour


def spec_of(text: str, metadata: Mapping[str, Any] | None) -> ShapeSpec:
    """The sample's spec: from ShapesEval metadata when present, else parsed from the text."""
    if metadata and "shapes_eval" in metadata:
        return ShapeSpec.from_metadata(dict(metadata))
    return ShapeSpec.from_text(text)


def _inputs(batch: ScoreBatch, name: str) -> tuple[Any, list[ShapeSpec]]:
    """``(images uint8 [n, H, W, 3], the n samples' specs)`` of a batch, checked."""
    images = as_uint8_batch(batch.images)
    n = len(batch.prompts)
    if len(images) != n:
        raise ValueError(f"{name}: {len(images)} images but {n} prompts")
    metadata = list(batch.metadata) or [None] * n
    return images, [spec_of(t, m) for t, m in zip(batch.prompts, metadata, strict=True)]


@register_reward("shapes_eval")
class ShapesEvalReward:
    """``shapes_eval``: components ``partial``, ``strict``; reads images, prompt, metadata."""

    components = ("partial", "strict")
    reads = frozenset({"images", "prompt", "metadata"})
    batchable = True
    thread_safe = True  # numpy only, no shared state

    def __init__(self, merge_parts: bool = False) -> None:
        if not isinstance(merge_parts, bool):
            raise RewardOptionError(
                f"shapes_eval: merge_parts must be true or false, got {merge_parts!r}"
            )
        self.merge_parts = merge_parts

    def __call__(self, batch: ScoreBatch) -> dict[str, list[float]]:
        images, specs = _inputs(batch, "shapes_eval")
        n = len(specs)
        partial, strict = [0.0] * n, [0.0] * n
        rows_of: dict[ShapeSpec, list[int]] = {}
        for i, spec in enumerate(specs):
            rows_of.setdefault(spec, []).append(i)
        for spec, rows in rows_of.items():  # one detector call per distinct prompt
            scores = score_batch(images[rows], spec, merge_parts=self.merge_parts)
            for i, sc in zip(rows, scores, strict=True):
                partial[i] = float(sc.partial)
                strict[i] = 1.0 if sc.strict else 0.0
        return {"partial": partial, "strict": strict}


@register_reward("shapes_colour_spread")
class ShapesColourSpreadReward:
    """``shapes_colour_spread``: within a group whose prompt names no colour, rewards an image
    for drawing a colour the rest of its group draws rarely, so that a group-relative
    advantage no longer favours the colours the detector reads most easily.

    Component ``spread``: ``1 - k / n`` for an image whose detected objects are mostly of a
    colour that ``k`` of the group's ``n`` coloured images share (its own included); 0 for an
    image with no object of a palette colour, and 0 for every image where the prompt names a
    colour (there the colour is the prompt's business, and a constant moves no advantage).
    Weighted beside ``shapes_eval``, e.g. ``shapes_eval,shapes_colour_spread:0.1``. Its value
    depends on the whole group, so it is called one group at a time (``batchable`` False).
    """

    components = ("spread",)
    reads = frozenset({"images", "prompt", "metadata"})
    batchable = False
    thread_safe = True

    def __call__(self, batch: ScoreBatch) -> dict[str, list[float]]:
        images, specs = _inputs(batch, "shapes_colour_spread")
        n = len(specs)
        if len(set(specs)) != 1:
            raise ValueError(
                f"shapes_colour_spread scores one group at a time, got {len(set(specs))}"
            )
        spec = specs[0]
        if any(o.colour is not None for o in spec.objects):
            return {"spread": [0.0] * n}
        dominant = [dominant_colour(sc) for sc in score_batch(images, spec)]
        coloured = [c for c in dominant if c is not None]
        return {
            "spread": [
                0.0 if c is None else 1.0 - coloured.count(c) / len(coloured) for c in dominant
            ]
        }
