"""The ShapesEval detector reward: rules, no learned weights.

Pipeline per image (``docs/shapes_eval.md`` gives every rule and threshold):

1. background = median of the border pixels; pixels are classified into palette colours,
   background, or unknown (:mod:`omnirl.reward.shapes.segment`);
2. 8-connected components of equal class; components below ``min_area`` are specks
   (not objects, but their pixels are clutter), every other component is an object (with
   ``merge_parts``, parts of no palette colour join the palette object they touch first:
   :func:`omnirl.reward.shapes.segment.merge_unknown_parts`);
3. each object's shape comes from the moments of its coverage, confirmed by a template
   fitted to its bounding box, or is ``"unknown"`` (:mod:`omnirl.reward.shapes.classify`);
4. objects are matched to the spec's groups; objects the spec does not ask for are extras
   and count against both scores, as do clutter and a textured background.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omnirl.reward.shapes.classify import classify_shape
from omnirl.reward.shapes.segment import (
    BACKGROUND_CLASS,
    UNKNOWN,
    classify_pixels,
    estimate_background,
    label_components,
    merge_unknown_parts,
    to_opponent,
)
from omnirl.reward.shapes.world import BACKGROUND, COLOURS, ShapeSpec

MIN_AREA_FRACTION = 0.004  # components below max(4 px, this * H * W) are specks
# Objects below this (x H x W) are too small to have a shape: unknown, so they never match
# (12 px at 32 x 32; the renderer's smallest triangle has about 20).
MIN_SHAPE_FRACTION = 0.012
POSITION_THRESHOLD = 0.1  # GenEval's position rule (centre offset shrunk by 0.1 * dims)
CLUTTER_TOL, CLUTTER_MAX = 0.01, 0.10  # fraction of the image in specks / stray pixels
ROUGHNESS_TOL, ROUGHNESS_MAX = 24.0, 56.0  # RMS distance of the open background to its colour
BACKGROUND_OFF_TOL, BACKGROUND_OFF_MAX = 20.0, 80.0  # background colour vs. BACKGROUND
HALF = 0.5  # credit for an object with the right shape or the right colour, not both


class ShapeImageError(ValueError):
    """The images handed to the detector have the wrong type, dtype or shape."""


@dataclass(slots=True)
class ShapeScore:
    """``partial`` in [0, 1] for training; ``strict`` pass / fail for the metric."""

    partial: float
    strict: bool
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Detected:
    colour: str  # palette name or "unknown"
    shape: str  # "circle" | "square" | "triangle" | "unknown"
    bbox: tuple[int, int, int, int]  # x0, y0, x1, y1 inclusive pixel indices
    area: int
    features: dict[str, float]  # see omnirl.reward.shapes.classify


def _coverage(
    labels: np.ndarray,
    classes: np.ndarray,
    alpha: np.ndarray,
    label: int,
    cls: int,
    box: tuple[int, int, int, int],
) -> np.ndarray:
    """Coverage of one palette-coloured component over its box grown by one pixel.

    Its own pixels weigh their ``alpha``; background pixels next to it weigh their
    ``alpha`` toward its colour (edges the 0.5 threshold dropped), if at least 0.1.
    """
    x0, y0, x1, y1 = box
    h, w = labels.shape
    ya, yb, xa, xb = max(0, y0 - 1), min(h, y1 + 2), max(0, x0 - 1), min(w, x1 + 2)
    own = labels[ya:yb, xa:xb] == label
    a = alpha[ya:yb, xa:xb, cls]
    grown = np.pad(own, 1)
    near = np.zeros_like(own)
    for dy in range(3):
        for dx in range(3):
            near |= grown[dy : dy + own.shape[0], dx : dx + own.shape[1]]
    edge = near & ~own & (classes[ya:yb, xa:xb] == BACKGROUND_CLASS) & (a >= 0.1)
    return np.where(own | edge, a, 0.0)


def _objects(
    labels: np.ndarray, classes: np.ndarray, alpha: np.ndarray, min_area: int, min_shape: int
) -> tuple[list[Detected], list[int], int]:
    """Objects of one image (``labels``, ``classes`` ``[H, W]``, ``alpha`` ``[H, W, K]``),
    their component labels, and the image's speck pixel count."""
    ys, xs = np.nonzero(labels >= 0)
    if len(ys) == 0:
        return [], [], 0
    ids, inverse, areas = np.unique(labels[ys, xs], return_inverse=True, return_counts=True)
    order = np.argsort(inverse, kind="stable")
    starts = np.concatenate([[0], np.cumsum(areas)[:-1]])
    x0 = np.minimum.reduceat(xs[order], starts)
    x1 = np.maximum.reduceat(xs[order], starts)
    y0 = np.minimum.reduceat(ys[order], starts)
    y1 = np.maximum.reduceat(ys[order], starts)
    objects, object_labels, speck_pixels = [], [], 0
    for i, label in enumerate(ids):
        if areas[i] < min_area:
            speck_pixels += int(areas[i])
            continue
        box = (int(x0[i]), int(y0[i]), int(x1[i]), int(y1[i]))
        mask = labels[box[1] : box[3] + 1, box[0] : box[2] + 1] == label
        cls = int(classes[ys[order[starts[i]]], xs[order[starts[i]]]])
        if cls == UNKNOWN:
            colour, weights = "unknown", mask.astype(np.float64)
        else:
            colour, weights = COLOURS[cls], _coverage(labels, classes, alpha, label, cls, box)
        if areas[i] >= min_shape:
            shape, features = classify_shape(weights, mask)
        else:
            shape, features = "unknown", {}
        objects.append(Detected(colour, shape, box, int(areas[i]), features))
        object_labels.append(int(label))
    return objects, object_labels, speck_pixels


def relations_between(a: Detected, b: Detected) -> set[str]:
    """GenEval's rule: relations of A to B from bounding-box centres and sizes."""
    box_a = np.array([a.bbox[0], a.bbox[1], a.bbox[2] + 1, a.bbox[3] + 1], dtype=np.float64)
    box_b = np.array([b.bbox[0], b.bbox[1], b.bbox[2] + 1, b.bbox[3] + 1], dtype=np.float64)
    offset = (box_a[:2] + box_a[2:]) / 2 - (box_b[:2] + box_b[2:]) / 2
    dims = (box_a[2:] - box_a[:2]) + (box_b[2:] - box_b[:2])
    revised = np.maximum(np.abs(offset) - POSITION_THRESHOLD * dims, 0) * np.sign(offset)
    if np.all(np.abs(revised) < 1e-3):
        return set()
    dx, dy = revised / np.linalg.norm(offset)
    out = set()
    if dx < -0.5:
        out.add("left of")
    if dx > 0.5:
        out.add("right of")
    if dy < -0.5:
        out.add("above")
    if dy > 0.5:
        out.add("below")
    return out


def _match(objects: list[Detected], spec: ShapeSpec) -> list[tuple[int, int, float]]:
    """Assign detected objects to groups: ``(group, object, weight)``, full matches first."""

    def weight(o: Detected, g: int) -> float:
        want = spec.objects[g]
        shape_ok = o.shape == want.shape
        colour_ok = o.colour == want.colour if want.colour else o.colour != "unknown"
        if shape_ok and colour_ok:
            return 1.0
        if want.colour is None:
            return HALF if shape_ok else 0.0
        return HALF if shape_ok or colour_ok else 0.0

    room = [o.count for o in spec.objects]
    taken: set[int] = set()
    matches = []
    for level in (1.0, HALF):
        for g in range(len(spec.objects)):
            for j, o in enumerate(objects):
                if room[g] and j not in taken and weight(o, g) == level:
                    matches.append((g, j, level))
                    taken.add(j)
                    room[g] -= 1
    return matches


def _falloff(value: float, tol: float, limit: float) -> float:
    """1 up to ``tol``, linear down to 0 at ``limit``."""
    return float(np.clip(1.0 - (value - tol) / (limit - tol), 0.0, 1.0))


def _score_one(
    objects: list[Detected],
    clutter: float,
    roughness: float,
    background: np.ndarray,
    spec: ShapeSpec,
) -> ShapeScore:
    matches = _match(objects, spec)
    matched = {j for _, j, _ in matches}
    extras = [j for j in range(len(objects)) if j not in matched]
    required = sum(o.count for o in spec.objects)
    full = [
        sum(1 for g2, _, w in matches if g2 == g and w == 1.0) for g in range(len(spec.objects))
    ]
    reasons = []
    for g, want in enumerate(spec.objects):
        if full[g] < want.count:
            reasons.append(f"group {g} ({want.phrase()}): {full[g]} of {want.count} matched")
    relation_ok = None
    if spec.relation is not None:
        best: dict[int, tuple[int, float]] = {}
        for g, j, w in matches:
            if g not in best or w > best[g][1]:
                best[g] = (j, w)
        relation_ok = (
            0 in best
            and 1 in best
            and (spec.relation in relations_between(objects[best[0][0]], objects[best[1][0]]))
        )
        if not relation_ok:
            reasons.append(f"relation {spec.relation!r} does not hold")
    if extras:
        reasons.append(f"{len(extras)} object(s) not asked for")
    off = float(np.linalg.norm(to_opponent(background) - to_opponent(np.array(BACKGROUND))))
    if clutter > CLUTTER_TOL:
        reasons.append(f"clutter {clutter:.3f} > {CLUTTER_TOL}")
    if roughness > ROUGHNESS_TOL:
        reasons.append(f"background roughness {roughness:.1f} > {ROUGHNESS_TOL}")
    if off > BACKGROUND_OFF_TOL:
        reasons.append(f"background {background.round().tolist()} is not the plain background")

    has_relation = spec.relation is not None
    credit = sum(w for _, _, w in matches) + (1.0 if relation_ok else 0.0)
    partial = credit / (required + has_relation + len(extras))
    partial *= _falloff(clutter, CLUTTER_TOL, CLUTTER_MAX)
    partial *= _falloff(roughness, ROUGHNESS_TOL, ROUGHNESS_MAX)
    partial *= _falloff(off, BACKGROUND_OFF_TOL, BACKGROUND_OFF_MAX)
    details = {
        "objects": [
            {"colour": o.colour, "shape": o.shape, "bbox": list(o.bbox), "area": o.area}
            for o in objects
        ],
        "matches": [[g, j, w] for g, j, w in matches],
        "extras": extras,
        "relation_ok": relation_ok,
        "clutter": round(clutter, 4),
        "roughness": round(roughness, 2),
        "reasons": reasons,
    }
    return ShapeScore(partial=float(partial), strict=not reasons, details=details)


def _as_images(images: Any) -> np.ndarray:
    if hasattr(images, "detach"):  # a torch tensor (the reward worker's decoded frame)
        images = images.detach().cpu().numpy()
    if not isinstance(images, np.ndarray):
        raise ShapeImageError(
            f"images must be a numpy array or tensor, got {type(images).__name__}"
        )
    if images.dtype != np.uint8:
        raise ShapeImageError(f"images must be uint8, got {images.dtype}")
    if images.ndim != 4 or images.shape[-1] != 3 or min(images.shape[1:3]) < 8:
        raise ShapeImageError(f"images must be [G, H, W, 3] with H, W >= 8, got {images.shape}")
    return images


def _open_background(object_mask: np.ndarray) -> np.ndarray:
    """Pixels at least one pixel away from every object: bool ``[H, W]``.

    Specks and unknown pixels belong to it, so a textured background cannot hide in them.
    """
    grown = np.pad(object_mask, 1)
    h, w = object_mask.shape
    near = np.zeros_like(object_mask)
    for dy in range(3):
        for dx in range(3):
            near |= grown[dy : dy + h, dx : dx + w]
    return ~near


def dominant_colour(result: ShapeScore) -> str | None:
    """The palette colour most of ``result``'s detected objects have (ties: palette order);
    None when no object has a palette colour."""
    colours = [o["colour"] for o in result.details.get("objects", ()) if o["colour"] in COLOURS]
    return max(COLOURS, key=colours.count) if colours else None


# the command-line help of ``merge_parts`` (measure, eval_shapes, shapes_curve)
MERGE_PARTS_HELP = "the detector joins parts of no palette colour to the palette object they touch"


def score_batch(
    images: Any, spec: ShapeSpec | dict[str, Any], *, merge_parts: bool = False
) -> list[ShapeScore]:
    """Score a group of images of one prompt.

    images: uint8 ``[G, H, W, 3]`` (numpy or torch); spec: a :class:`ShapeSpec` or its
    metadata dict. ``merge_parts``: a part of no palette colour touching a palette object
    is part of that object, not an extra (off by default: ``docs/shapes_eval.md``, "Parts
    of no palette colour"). Raises :class:`ShapeImageError` / ``ShapeSpecError`` on bad
    input.
    """
    images = _as_images(images)
    if not isinstance(spec, ShapeSpec):
        spec = ShapeSpec.from_metadata(spec)
    g, h, w, _ = images.shape
    min_area = max(4, round(MIN_AREA_FRACTION * h * w))
    min_shape = max(min_area, round(MIN_SHAPE_FRACTION * h * w))
    background = estimate_background(images)
    classes, bg_distance, alpha = classify_pixels(images, background)
    labels = label_components(classes)
    scores = []
    for i in range(g):
        image_labels, image_classes, image_alpha = labels[i], classes[i], alpha[i]
        if merge_parts:
            image_labels, image_classes, image_alpha = merge_unknown_parts(
                image_labels, image_classes, image_alpha, min_area
            )
        objects, object_labels, speck_pixels = _objects(
            image_labels, image_classes, image_alpha, min_area, min_shape
        )
        clutter = speck_pixels / (h * w)
        far = bg_distance[i][_open_background(np.isin(image_labels, object_labels))]
        roughness = float(np.sqrt(np.mean(far**2))) if far.size else ROUGHNESS_MAX
        scores.append(_score_one(objects, clutter, roughness, background[i], spec))
    return scores


def score(image: Any, spec: ShapeSpec | dict[str, Any], *, merge_parts: bool = False) -> ShapeScore:
    """Score one uint8 ``[H, W, 3]`` image against ``spec`` (see :func:`score_batch`)."""
    if hasattr(image, "detach"):
        image = image.detach().cpu().numpy()
    if not isinstance(image, np.ndarray) or image.ndim != 3:
        raise ShapeImageError(
            f"image must be one [H, W, 3] array, got {getattr(image, 'shape', type(image).__name__)}"
        )
    return score_batch(image[None], spec, merge_parts=merge_parts)[0]
