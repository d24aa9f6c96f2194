"""ShapesT2I rollout adapter: the SD3 rollout adapter with this family's text encoder and
decoding (pixels, or the tiny VAE of a latent model).

Sampling (schedule, CFG, SDE steps, seeds, recording) is :class:`SD3RolloutAdapter`'s,
unchanged; only prompt encoding (word tokenizer + small CLIP, negatives from
``sampling.negative_prompt``) and decoding differ.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from omnirl.models.registry import register_rollout_adapter
from omnirl.models.sd3.rollout_adapter import SD3RolloutAdapter
from omnirl.models.sd3.step import SD3Conditioning
from omnirl.models.shapes_t2i.encoder import encode_shapes_prompts
from omnirl.models.shapes_t2i.pipeline import ARCHITECTURE, ShapesT2IPipeline
from omnirl.protocol.messages import SamplingParams


@register_rollout_adapter(ARCHITECTURE)
class ShapesT2IRolloutAdapter(SD3RolloutAdapter):
    """``ShapesT2IPipeline`` behind the rollout contract (images uint8 ``[G, H, W, 3]``)."""

    architecture = ARCHITECTURE

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        lora: dict[str, Any] | None = None,
        max_sequence_length: int | None = None,
    ) -> ShapesT2IRolloutAdapter:
        pipe = ShapesT2IPipeline.from_pretrained(path, dtype=dtype).to(device)
        pipe.text_encoder.eval()
        return cls(pipe, device=device, lora=lora, max_sequence_length=max_sequence_length)

    def _encode(self, texts: list[str], sampling: SamplingParams, do_cfg: bool) -> SD3Conditioning:
        return encode_shapes_prompts(
            self.pipeline, texts, do_cfg=do_cfg, negative_prompt=sampling.negative_prompt
        )

    @torch.no_grad()
    def _decode(self, latents: Tensor) -> Tensor:
        """Latents float32 (pixels ``[B, 3, H, W]`` in [-1, 1], or VAE latents) -> uint8
        ``[B, H, W, 3]``."""
        return self.pipeline.latents_to_images(latents)
