"""JPEG compressibility rewards, as DDPO (Black et al., 2023) defines them.

Each image is saved as a JPEG with PIL at quality 95; its size in kilobytes
(``bytes / 1000``) is the *incompressibility* reward, and its negation the
*compressibility* reward. (flow_grpo additionally divides compressibility by 500; DDPO
does not, and neither do we: scale rewards with the reward weight instead.)
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
from PIL import Image

from omnirl.reward.scorers.registry import register_scorer

JPEG_QUALITY = 95


class ImageBatchError(ValueError):
    """Images handed to a scorer are not a uint8 ``[G, H, W, 3]`` batch."""


def as_uint8_batch(images: Any) -> np.ndarray:
    """Return ``images`` as a C-contiguous uint8 numpy array ``[G, H, W, 3]``.

    Accepts a ``torch.Tensor`` or a numpy array (read-only buffers are fine: nothing is
    written). Anything else, another dtype or another shape raises :class:`ImageBatchError`.
    """
    if hasattr(images, "detach") and hasattr(images, "numpy"):  # torch.Tensor, lazily
        images = images.detach().cpu().numpy()
    if not isinstance(images, np.ndarray):
        raise ImageBatchError(f"images must be a torch.Tensor or numpy array, got {type(images)}")
    if images.dtype != np.uint8:
        raise ImageBatchError(f"images must be uint8, got {images.dtype}")
    if images.ndim != 4 or images.shape[-1] != 3:
        raise ImageBatchError(f"images must have shape [G, H, W, 3], got {list(images.shape)}")
    return np.ascontiguousarray(images)


def jpeg_sizes_kb(images: Any) -> list[float]:
    """JPEG size (quality 95) of each image in kB (1 kB = 1000 bytes); images ``[G, H, W, 3]``."""
    sizes = []
    for image in as_uint8_batch(images):
        buffer = io.BytesIO()
        Image.fromarray(image, mode="RGB").save(buffer, format="JPEG", quality=JPEG_QUALITY)
        sizes.append(buffer.tell() / 1000.0)
    return sizes


@register_scorer("jpeg_incompressibility")
def jpeg_incompressibility(images: Any, prompts: list[str] | None = None) -> list[float]:
    """Reward = JPEG size in kB: larger files (more detail, more noise) score higher."""
    return jpeg_sizes_kb(images)


@register_scorer("jpeg_compressibility")
def jpeg_compressibility(images: Any, prompts: list[str] | None = None) -> list[float]:
    """Reward = minus the JPEG size in kB: smaller files (flatter images) score higher."""
    return [-size for size in jpeg_sizes_kb(images)]
