"""JPEG compressibility / incompressibility as DDPO defines them."""

import io

import numpy as np
import pytest
import torch
from PIL import Image

from omnirl.reward.scorers import (
    UnknownScorer,
    available_scorers,
    get_scorer,
    jpeg_compressibility,
    jpeg_incompressibility,
)
from omnirl.reward.scorers.jpeg import ImageBatchError


def _reference_size_kb(image: np.ndarray) -> float:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="JPEG", quality=95)
    return len(buffer.getvalue()) / 1000


def _batch(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    flat = np.full((32, 32, 3), 128, dtype=np.uint8)
    noisy = rng.integers(0, 256, size=(32, 32, 3), dtype=np.uint8)
    return np.stack([flat, noisy])


def test_sizes_match_pil_quality_95_in_kilobytes():
    images = _batch()
    expected = [_reference_size_kb(im) for im in images]
    assert jpeg_incompressibility(images) == pytest.approx(expected)
    assert jpeg_compressibility(images) == pytest.approx([-e for e in expected])


def test_noise_is_less_compressible_than_a_flat_image():
    flat_score, noisy_score = jpeg_compressibility(_batch())
    assert flat_score > noisy_score
    flat_size, noisy_size = jpeg_incompressibility(_batch())
    assert noisy_size > flat_size > 0


def test_torch_and_read_only_inputs_score_the_same():
    images = _batch(1)
    read_only = images.copy()
    read_only.setflags(write=False)
    tensor = torch.frombuffer(bytearray(images.tobytes()), dtype=torch.uint8).view(images.shape)
    expected = jpeg_compressibility(images)
    assert jpeg_compressibility(read_only) == expected
    assert jpeg_compressibility(tensor) == expected


@pytest.mark.parametrize(
    "bad",
    [
        np.zeros((2, 8, 8, 3), dtype=np.float32),
        np.zeros((8, 8, 3), dtype=np.uint8),
        np.zeros((2, 8, 8, 4), dtype=np.uint8),
        [[0, 1, 2]],
    ],
)
def test_bad_images_are_refused_with_a_typed_error(bad):
    with pytest.raises(ImageBatchError):
        jpeg_compressibility(bad)


def test_registry_knows_both_and_lists_names_on_a_miss():
    assert {"jpeg_compressibility", "jpeg_incompressibility"} <= set(available_scorers())
    assert get_scorer("jpeg_compressibility") is jpeg_compressibility
    with pytest.raises(UnknownScorer, match="jpeg_incompressibility"):
        get_scorer("aesthetic_v9")
