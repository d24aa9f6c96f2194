"""OCR reward (Flow-GRPO's definition) with the rapidocr ONNX models shipped in its wheel."""

import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageFont

from omnirl.reward.scorers import ScoreBatch, build_reward
from omnirl.reward.scorers.ocr import levenshtein, ocr_similarity, target_text


def test_target_is_the_quoted_text_without_spaces_lower_cased():
    assert target_text('A sign that says "Hello World" on a wall') == "helloworld"
    assert target_text("no quotes Here") == "noquoteshere"


def test_similarity_is_one_minus_normalised_clamped_edit_distance():
    assert levenshtein("kitten", "sitting") == 3
    assert levenshtein("", "abc") == 3
    assert ocr_similarity("Hello World", "helloworld") == 1.0
    assert ocr_similarity("hellp world", "helloworld") == pytest.approx(0.9)
    assert ocr_similarity("", "helloworld") == 0.0
    assert ocr_similarity("x" * 50, "abc") == 0.0  # distance clamped to len(target)


def rendered(text: str) -> np.ndarray:
    image = Image.new("RGB", (512, 160), "white")
    font = ImageFont.load_default(size=56)
    ImageDraw.Draw(image).text((24, 45), text, fill="black", font=font)
    return np.asarray(image)


@pytest.fixture(scope="module")
def ocr():
    return build_reward("ocr")


def test_rendered_text_scores_near_one_and_noise_near_zero(ocr):
    noise = np.random.default_rng(0).integers(0, 256, (160, 512, 3), dtype=np.uint8)
    images = np.stack([rendered("Hello World"), rendered("Open Door"), noise])
    prompts = ['a sign saying "Hello World"', 'a poster with "OPEN DOOR"', 'a sign "Hello World"']
    scores = ocr(ScoreBatch(images, prompts, [{}] * 3))["ocr"]
    assert scores[0] >= 0.9
    assert scores[1] >= 0.85
    assert scores[2] <= 0.2


def test_wrong_text_scores_low(ocr):
    images = rendered("Goodbye")[None]
    (score,) = ocr(ScoreBatch(images, ['"Hello World"'], [{}]))["ocr"]
    assert score < 0.5
