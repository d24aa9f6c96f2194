"""ShapesEval: a procedural world of coloured shapes, its renderer and a rule-based detector.

``ShapeSpec.from_metadata(prompt.metadata)`` reads a prompt's spec; ``render(spec, size,
seed)`` draws uint8 ``[H, W, 3]``; ``score_batch(images, spec)`` scores uint8
``[G, H, W, 3]`` into ``ShapeScore(partial, strict, details)`` per image.
"""

from omnirl.reward.shapes.detector import ShapeImageError, ShapeScore, score, score_batch
from omnirl.reward.shapes.render import render, render_batch
from omnirl.reward.shapes.world import (
    CATEGORIES,
    ShapeObject,
    ShapeSpec,
    ShapeSpecError,
    generate_prompts,
    specs_in_split,
    split_of,
)

__all__ = [
    "CATEGORIES",
    "ShapeImageError",
    "ShapeObject",
    "ShapeScore",
    "ShapeSpec",
    "ShapeSpecError",
    "generate_prompts",
    "render",
    "render_batch",
    "score",
    "score_batch",
    "specs_in_split",
    "split_of",
]
