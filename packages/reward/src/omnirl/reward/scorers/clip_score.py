"""CLIP score, and the CLIP loading code PickScore and the aesthetic predictor share.

A model folder is what ``save_pretrained`` writes for a ``transformers.CLIPModel`` and its
processor: ``config.json``, ``model.safetensors``, the tokenizer files
(``tokenizer.json`` / ``vocab.json`` + ``merges.txt``, ``tokenizer_config.json``) and the
image processor's ``preprocessor_config.json`` / ``processor_config.json``. It is loaded with
``local_files_only=True``: nothing is downloaded. ``processor=`` may name another folder
(PickScore's model ships without its processor, which is the one of the CLIP-H it was tuned
from).

``clip_score`` = cosine similarity of the L2-normalised CLIP image and text embeddings, in
``[-1, 1]`` (torchmetrics' CLIPScore is ``max(100 * cos, 0)``: scale with the reward weight).
For real weights, download e.g. ``openai/clip-vit-large-patch14`` to a folder elsewhere and
pass ``clip_score(model=/that/folder)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from omnirl.reward.scorers.jpeg import as_uint8_batch
from omnirl.reward.scorers.registry import ScoreBatch, register_reward


class ModelFolderError(ValueError):
    """A model folder that is missing or cannot be loaded as a CLIP model + processor."""


@dataclass(slots=True)
class ClipBundle:
    """A loaded CLIP model (eval mode, on ``device``) and its processor."""

    model: Any  # transformers.CLIPModel
    processor: Any  # its CLIPProcessor
    device: Any  # torch.device
    dtype: Any  # torch.dtype of the model weights


def load_clip(model: str, *, processor: str = "", device: str = "cpu", dtype: str = "float32"):
    """Load ``CLIPModel`` from the folder ``model`` and its processor; raise ModelFolderError."""
    from pathlib import Path

    import torch
    from transformers import AutoProcessor, CLIPModel

    for folder in {model, processor or model}:
        if not folder or not Path(folder).is_dir():
            raise ModelFolderError(f"CLIP model folder {folder!r} does not exist")
    try:
        torch_dtype = getattr(torch, dtype)
        net = CLIPModel.from_pretrained(model, local_files_only=True, dtype=torch_dtype)
        proc = AutoProcessor.from_pretrained(processor or model, local_files_only=True)
    except (OSError, ValueError, AttributeError) as exc:
        raise ModelFolderError(f"cannot load a CLIP model from {model!r}: {exc}") from exc
    net.eval().requires_grad_(False).to(torch.device(device))
    return ClipBundle(net, proc, torch.device(device), torch_dtype)


def _features(out: Any):
    """transformers 5 returns a ModelOutput from ``get_*_features``; 4.x a tensor."""
    return out if hasattr(out, "norm") else out.pooler_output


def image_embeddings(clip: ClipBundle, images: np.ndarray):
    """L2-normalised float32 image embeddings ``[n, D]`` of uint8 images ``[n, H, W, 3]``."""
    import torch

    pixels = clip.processor(images=list(as_uint8_batch(images)), return_tensors="pt")
    pixel_values = pixels["pixel_values"].to(clip.device, clip.dtype)
    with torch.no_grad():
        emb = _features(clip.model.get_image_features(pixel_values=pixel_values)).float()
    return emb / emb.norm(dim=-1, keepdim=True)


def text_embeddings(clip: ClipBundle, texts: list[str]):
    """L2-normalised float32 text embeddings ``[n, D]`` (texts truncated to the model's length)."""
    import torch

    tokens = clip.processor(
        text=texts, return_tensors="pt", padding=True, truncation=True, max_length=77
    )
    with torch.no_grad():
        emb = _features(
            clip.model.get_text_features(
                input_ids=tokens["input_ids"].to(clip.device),
                attention_mask=tokens["attention_mask"].to(clip.device),
            )
        ).float()
    return emb / emb.norm(dim=-1, keepdim=True)


def prompt_image_cosine(clip: ClipBundle, batch: ScoreBatch):
    """float32 ``[n]`` cosine between each image and its prompt (each distinct prompt encoded once)."""
    unique = sorted(set(batch.prompts))
    text = text_embeddings(clip, unique)
    index = [unique.index(p) for p in batch.prompts]
    return (image_embeddings(clip, batch.images) * text[index]).sum(-1)


@register_reward("clip_score")
class ClipScore:
    """``clip_score(model=FOLDER[;processor=FOLDER;device=cpu;dtype=float32])``."""

    components = ("clip_score",)
    reads = frozenset({"images", "prompt"})
    batchable = True
    thread_safe = False  # one model; torch already uses the cores within a call

    def __init__(
        self, model: str, processor: str = "", device: str = "cpu", dtype: str = "float32"
    ):
        self.clip = load_clip(model, processor=processor, device=device, dtype=dtype)

    def __call__(self, batch: ScoreBatch) -> dict[str, list[float]]:
        return {"clip_score": prompt_image_cosine(self.clip, batch).tolist()}
