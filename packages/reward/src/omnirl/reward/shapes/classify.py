"""Shape of one component: soft moments first, a template check second.

Moments are taken over the component's coverage (``alpha`` toward its colour, so an
anti-aliased or slightly blurred edge weighs what it covers), which keeps them stable
where a thresholded mask gains or loses whole corner pixels:

- elongation: ratio of the covariance eigenvalues; > ``MAX_ELONGATION`` is no shape we know
  (an upright triangle of base = height has 1.33, a 1.5:1 box 2.25);
- skewness ``hypot(skew_x, skew_y)``: 0.57 for a triangle, 0 for circles and squares;
- squareness ``E[4 x^2 y^2] / E[(x^2 - y^2)^2]`` over coordinates scaled to unit variance:
  2.5 for an axis-aligned square, 1.0 for a disc (any rotation-symmetric blob).

The chosen class must then also match its template (fitted to the thresholded mask's
bounding box) with IoU >= ``MIN_TEMPLATE_IOU``, so a ragged blob is ``"unknown"``.
"""

from __future__ import annotations

import numpy as np

MAX_ELONGATION = 2.0
TRIANGLE_SKEW = 0.3
SQUARENESS = 1.6  # between the disc's 1.0 and the square's 2.5, nearer the disc (blur)
MIN_TEMPLATE_IOU = 0.55


def templates(h: int, w: int) -> dict[str, list[np.ndarray]]:
    """Ideal masks filling an ``h x w`` box, sampled at pixel centres.

    A small shape's pixel mask depends on where it falls on the grid, so the round
    templates come in a few sizes (grown by up to half a pixel); the best one counts.
    """
    y = np.arange(h, dtype=np.float32)[:, None] + 0.5  # pixel centres, box coordinates
    x = np.arange(w, dtype=np.float32)[None, :] + 0.5
    out: dict[str, list[np.ndarray]] = {"square": [np.ones((h, w), dtype=bool)]}
    out["circle"] = [
        ((x - w / 2) / (w / 2 + g)) ** 2 + ((y - h / 2) / (h / 2 + g)) ** 2 <= 1.0
        for g in (0.0, 0.25, 0.5)
    ]
    # apex at the top centre, base along the bottom row
    out["triangle"] = [np.abs(x - w / 2) <= (w / 2) * (y / h) + g for g in (0.0, 0.25, 0.5)]
    return out


def template_iou(mask: np.ndarray, shape: str) -> float:
    """Best IoU of ``mask`` (bool ``[h, w]``, cropped to its box) with ``shape``'s templates."""
    h, w = mask.shape
    area = int(mask.sum())
    best = 0.0
    for template in templates(h, w)[shape]:
        inter = int(np.logical_and(mask, template).sum())
        best = max(best, inter / (area + int(template.sum()) - inter))
    return best


def moment_features(weights: np.ndarray) -> dict[str, float]:
    """Elongation, skewness and squareness of a coverage map (float ``[h, w]``, >= 0)."""
    h, w = weights.shape
    ys, xs = np.mgrid[0:h, 0:w].astype(np.float64)
    m0 = float(weights.sum())
    x = xs - (weights * xs).sum() / m0
    y = ys - (weights * ys).sum() / m0

    def mean(values: np.ndarray) -> float:
        return float((weights * values).sum() / m0)

    vxx, vyy, vxy = mean(x * x), mean(y * y), mean(x * y)
    spread = np.sqrt(((vxx - vyy) / 2) ** 2 + vxy**2)
    lo, hi = (vxx + vyy) / 2 - spread, (vxx + vyy) / 2 + spread
    elongation = hi / lo if lo > 1e-9 else float("inf")
    sx, sy = np.sqrt(max(vxx, 1e-9)), np.sqrt(max(vyy, 1e-9))
    skew = float(np.hypot(mean(x**3) / sx**3, mean(y**3) / sy**3))
    u, v = x / sx, y / sy
    squareness = mean(4 * u * u * v * v) / max(mean((u * u - v * v) ** 2), 1e-9)
    return {"elongation": float(elongation), "skew": skew, "squareness": float(squareness)}


def classify_shape(weights: np.ndarray, mask: np.ndarray) -> tuple[str, dict[str, float]]:
    """Shape name (``"circle"``, ``"square"``, ``"triangle"`` or ``"unknown"``) and features.

    weights: coverage around the component, float ``[h', w']``; mask: the component's
    thresholded pixels cropped to their bounding box, bool ``[h, w]``.
    """
    features = moment_features(weights)
    if features["elongation"] > MAX_ELONGATION:
        return "unknown", features
    if features["skew"] >= TRIANGLE_SKEW:
        shape = "triangle"
    elif features["squareness"] >= SQUARENESS:
        shape = "square"
    else:
        shape = "circle"
    features["iou"] = template_iou(mask, shape)
    return (shape if features["iou"] >= MIN_TEMPLATE_IOU else "unknown"), features
