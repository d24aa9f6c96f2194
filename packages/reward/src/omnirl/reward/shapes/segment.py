"""Pixel classes and connected components for the ShapesEval detector (numpy only).

Colour model: every pixel is read as a blend ``bg + alpha * (colour - bg) + error`` of the
image's background and one palette colour (anti-aliased edges and slight blur are exactly
such blends). Distances are measured in an opponent colour space (orthonormal luminance /
red-green / yellow-blue axes, luminance weighted down), a cheap perceptual-ish space that is
still linear, so blends stay on straight lines.

A pixel is
- colour ``k`` when it lies near the line bg -> ``k`` (residual <= ``FIT_RESIDUAL``) and
  at least half way along it (``alpha >= 0.5``);
- background when it lies near such a line but less than half way, or near the background
  itself (distance <= ``BG_DISTANCE``);
- unknown (``UNKNOWN``) otherwise: a colour outside the palette (black, brown, a blend of
  two palette colours).
"""

from __future__ import annotations

import numpy as np

from omnirl.reward.shapes.world import PALETTE

BACKGROUND_CLASS = -1
UNKNOWN = len(PALETTE)  # class index of "a colour that is not in the palette"

FIT_RESIDUAL = 35.0  # opponent-space units; the closest palette lines are > 60 apart
BG_DISTANCE = 45.0

_SQ2, _SQ3, _SQ6 = np.sqrt(2.0), np.sqrt(3.0), np.sqrt(6.0)
# rows: luminance (weighted 0.5), red-green, yellow-blue; orthonormal before the weight
_OPPONENT = np.array(
    [
        [0.5 / _SQ3, 0.5 / _SQ3, 0.5 / _SQ3],
        [1 / _SQ2, -1 / _SQ2, 0.0],
        [1 / _SQ6, 1 / _SQ6, -2 / _SQ6],
    ],
    dtype=np.float32,
)
_PALETTE_RGB = np.array(list(PALETTE.values()), dtype=np.float32)  # [K, 3]


def to_opponent(rgb: np.ndarray) -> np.ndarray:
    """``[..., 3]`` RGB (0-255) to the detector's opponent space, float32."""
    return rgb.astype(np.float32) @ _OPPONENT.T


def estimate_background(images: np.ndarray) -> np.ndarray:
    """Per-image background colour: the median of the border pixels, float32 ``[G, 3]``."""
    border = np.concatenate(
        [images[:, 0], images[:, -1], images[:, 1:-1, 0], images[:, 1:-1, -1]], axis=1
    )
    return np.median(border.astype(np.float32), axis=1)


def classify_pixels(
    images: np.ndarray, background: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pixel classes, distance to the background, and coverage toward each palette colour.

    images: uint8 ``[G, H, W, 3]``; background: float32 ``[G, 3]`` RGB.
    Returns ``classes`` int8 ``[G, H, W]`` (``BACKGROUND_CLASS``, palette index, or
    ``UNKNOWN``), ``bg_distance`` float32 ``[G, H, W]`` (opponent-space units) and
    ``alpha`` float32 ``[G, H, W, K]`` (blend coefficient toward palette colour ``k``).
    """
    v = to_opponent(images) - to_opponent(background)[:, None, None, :]  # [G, H, W, 3]
    d = to_opponent(_PALETTE_RGB)[None, :, :] - to_opponent(background)[:, None, :]  # [G,K,3]
    dd = np.einsum("gkc,gkc->gk", d, d)  # [G, K]
    vd = np.einsum("ghwc,gkc->ghwk", v, d)  # [G, H, W, K]
    alpha = np.clip(vd / dd[:, None, None, :], 0.0, 1.0)
    vv = np.einsum("ghwc,ghwc->ghw", v, v)[..., None]
    # |v - alpha d|^2 expanded, so no [G, H, W, K, 3] array is built
    residual = np.sqrt(np.maximum(vv - 2 * alpha * vd + alpha**2 * dd[:, None, None, :], 0.0))
    best = residual.argmin(axis=-1)  # [G, H, W]
    best_residual = np.take_along_axis(residual, best[..., None], axis=-1)[..., 0]
    best_alpha = np.take_along_axis(alpha, best[..., None], axis=-1)[..., 0]
    bg_distance = np.sqrt(vv[..., 0])

    fits = best_residual <= FIT_RESIDUAL
    classes = np.full(best.shape, UNKNOWN, dtype=np.int8)
    classes[fits & (best_alpha >= 0.5)] = best[fits & (best_alpha >= 0.5)]
    classes[(fits & (best_alpha < 0.5)) | (bg_distance <= BG_DISTANCE)] = BACKGROUND_CLASS
    return classes, bg_distance, alpha


_NEIGHBOURS = [(dy, dx) for dy in (-1, 0, 1) for dx in (-1, 0, 1) if (dy, dx) != (0, 0)]


def label_components(classes: np.ndarray) -> np.ndarray:
    """8-connected components of equal non-background class, batched.

    classes: int ``[G, H, W]``. Returns int64 ``[G, H, W]``: -1 on background, else the
    flat index (into the whole batch) of the component's first pixel, so labels are unique
    across the batch. Min-label propagation with pointer jumping: every pass takes the
    smallest label among equal-class neighbours, then follows labels as pointers.
    """
    g, h, w = classes.shape
    n = g * h * w
    fg = classes != BACKGROUND_CLASS
    big = np.int64(n)
    labels = np.where(fg, np.arange(n, dtype=np.int64).reshape(g, h, w), big)
    padded_cls = np.pad(classes.astype(np.int16), ((0, 0), (1, 1), (1, 1)), constant_values=-2)
    same = [
        padded_cls[:, 1 + dy : 1 + dy + h, 1 + dx : 1 + dx + w] == classes for dy, dx in _NEIGHBOURS
    ]
    while True:
        padded = np.pad(labels, ((0, 0), (1, 1), (1, 1)), constant_values=big)
        new = labels.copy()
        for (dy, dx), ok in zip(_NEIGHBOURS, same, strict=True):
            shifted = padded[:, 1 + dy : 1 + dy + h, 1 + dx : 1 + dx + w]
            np.minimum(new, np.where(ok, shifted, big), out=new)
        flat = np.append(new.reshape(-1), big)  # index n (background) points to itself
        for _ in range(4):
            flat = flat[flat]
        new = flat[:n].reshape(g, h, w)
        if np.array_equal(new, labels):
            break
        labels = new
    return np.where(fg, labels, -1)


def merge_unknown_parts(
    labels: np.ndarray, classes: np.ndarray, alpha: np.ndarray, min_area: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One image's components with the parts of no palette colour joined to the palette
    object they touch: a drawn shape whose shade leaves the palette line over part of it
    (the model's darker colours do) is one object, not an object and an extra.

    labels: int ``[H, W]`` (:func:`label_components` of one image), classes ``[H, W]``,
    alpha float32 ``[H, W, K]``. A component of class ``UNKNOWN`` that touches
    (8-connected) a palette-coloured component of at least ``min_area`` pixels takes the
    label and class of the one it shares most neighbouring pixels with, and coverage 1
    toward its colour, as long as the palette part stays the larger: the unknown parts
    joined to an object never outweigh its palette pixels, so a dot of colour cannot make a
    large blot of no colour into an object of that colour. Returns copies.
    """
    labels, classes, alpha = labels.copy(), classes.copy(), alpha.copy()
    fg = labels >= 0
    ids, areas = np.unique(labels[fg], return_counts=True)
    area = dict(zip(ids.tolist(), areas.tolist(), strict=True))
    unknown = fg & (classes == UNKNOWN)
    hosts = fg & ~unknown & np.isin(labels, ids[areas >= min_area])
    if not hosts.any() or not unknown.any():
        return labels, classes, alpha
    # every (unknown pixel's part, neighbouring host) pair, once per neighbouring pixel
    host_labels = np.pad(np.where(hosts, labels, -1), 1, constant_values=-1)
    ys, xs = np.nonzero(unknown)
    pairs = np.concatenate(
        [
            np.stack([labels[ys, xs], host_labels[1 + dy + ys, 1 + dx + xs]], axis=1)
            for dy, dx in _NEIGHBOURS
        ]
    )
    pairs = pairs[pairs[:, 1] >= 0]
    if not len(pairs):
        return labels, classes, alpha
    parts_hosts, counts = np.unique(pairs, axis=0, return_counts=True)
    best: dict[int, tuple[int, int]] = {}  # part -> (shared neighbours, host)
    for (part, host), count in zip(parts_hosts.tolist(), counts.tolist(), strict=True):
        if count > best.get(part, (0, -1))[0]:
            best[part] = (count, host)
    joined: dict[int, int] = {}
    host_ids, first = np.unique(labels[hosts], return_index=True)
    host_class = dict(zip(host_ids.tolist(), classes[hosts][first].tolist(), strict=True))
    for part in sorted(best, key=lambda p: -area[p]):  # the largest parts claim first
        host = best[part][1]
        if joined.get(host, 0) + area[part] > area[host]:
            continue
        joined[host] = joined.get(host, 0) + area[part]
        part_mask = labels == part
        labels[part_mask], classes[part_mask] = host, host_class[host]
        alpha[part_mask, host_class[host]] = 1.0
    return labels, classes, alpha
