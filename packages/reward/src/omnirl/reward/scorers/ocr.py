"""OCR reward as Flow-GRPO defines it: ``1 - normalised edit distance`` to the target text.

- target: the text between the first pair of double quotes of the prompt (the whole prompt
  when it has none), with spaces removed and lower-cased;
- recognised: every text line the OCR engine finds, concatenated in its reading order,
  spaces removed, lower-cased;
- ``reward = 1 - min(levenshtein(recognised, target), len(target)) / max(len(target), 1)``,
  in ``[0, 1]``; an image with no text found scores 0.

Flow-GRPO runs PaddleOCR; we run ``rapidocr-onnxruntime``, whose wheel ships the PP-OCR
detection and recognition models as ONNX files (no download, CPU). Flow-GRPO also scores 0
when the OCR call raises; here an OCR failure refuses the group instead (never a silent 0).
"""

from __future__ import annotations

import threading
from typing import Any

from omnirl.reward.scorers.jpeg import as_uint8_batch
from omnirl.reward.scorers.registry import ScoreBatch, register_reward


def target_text(prompt: str) -> str:
    """The text an image of ``prompt`` should show, normalised (no spaces, lower case)."""
    if '"' in prompt:
        prompt = prompt.split('"')[1]
    return normalise(prompt)


def normalise(text: str) -> str:
    return text.replace(" ", "").lower()


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions each cost 1)."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def ocr_similarity(recognised: str, target: str) -> float:
    """Flow-GRPO's score of ``recognised`` against the normalised ``target``, in [0, 1]."""
    distance = min(levenshtein(normalise(recognised), target), len(target))
    return 1.0 - distance / max(len(target), 1)


@register_reward("ocr")
class OcrReward:
    """``ocr``: component ``ocr``; reads images and prompt. One OCR engine per thread."""

    components = ("ocr",)
    reads = frozenset({"images", "prompt"})
    batchable = True
    thread_safe = True  # each thread builds its own engine

    def __init__(self, min_confidence: float = 0.0, **engine_options: Any):
        self.min_confidence = float(min_confidence)
        self.engine_options = engine_options
        self._local = threading.local()

    def engine(self):
        engine = getattr(self._local, "engine", None)
        if engine is None:
            from rapidocr_onnxruntime import RapidOCR  # heavy (onnxruntime, cv2): lazily

            engine = self._local.engine = RapidOCR(**self.engine_options)
        return engine

    def recognise(self, image) -> str:
        """All text found in one uint8 ``[H, W, 3]`` RGB image, lines joined in reading order."""
        lines, _ = self.engine()(image[..., ::-1].copy(), use_cls=False)  # the engine wants BGR
        if not lines:
            return ""
        return "".join(text for _, text, conf in lines if float(conf) > self.min_confidence)

    def __call__(self, batch: ScoreBatch) -> dict[str, list[float]]:
        images = as_uint8_batch(batch.images)
        return {
            "ocr": [
                ocr_similarity(self.recognise(image), target_text(prompt))
                for image, prompt in zip(images, batch.prompts, strict=True)
            ]
        }
