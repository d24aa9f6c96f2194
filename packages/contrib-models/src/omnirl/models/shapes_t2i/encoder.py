"""ShapesT2I prompt and image encoding, shared by the rollout adapter and the trainer's offline
modes.

Prompts: the word tokenizer and the small CLIP text encoder (negatives from the negative
prompt when CFG is on), :func:`encode_shapes_prompts`, which the rollout adapter calls too.
Images: :meth:`~omnirl.models.shapes_t2i.pipeline.ShapesT2IPipeline.images_to_latents`, the
inverse of the ``latents_to_images`` the rollout adapter decodes with. A pixel model's encoding
is exact (uint8 to ``[-1, 1]``, decoded back bit for bit); a latent model's is its tiny VAE's
posterior mean with the pipeline's scaling, ``(z - shift_factor) * scaling_factor``, decoded
back up to the autoencoder's error.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

from omnirl.models.sd3.encoder import SD3SampleEncoder
from omnirl.models.sd3.step import SD3Conditioning
from omnirl.models.shapes_t2i.pipeline import ARCHITECTURE, ShapesT2IPipeline


@torch.no_grad()
def encode_shapes_prompts(
    pipeline: ShapesT2IPipeline, texts: list[str], *, do_cfg: bool, negative_prompt: str
) -> SD3Conditioning:
    """``(prompt_embeds [B, L, D], pooled [B, D'])``, plus the negative prompt's iff ``do_cfg``."""
    pe, pooled = pipeline.encode(texts)
    if not do_cfg:
        return SD3Conditioning(pe, pooled)
    npe, npooled = pipeline.encode([negative_prompt] * len(texts))
    return SD3Conditioning(pe, pooled, npe, npooled)


class ShapesT2ISampleEncoder(SD3SampleEncoder):
    """The tokenizer, text encoder and (latent models) VAE of a ShapesT2I folder; no
    transformer."""

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,  # unused: the text encoder stays float32
    ) -> ShapesT2ISampleEncoder:
        from diffusers import AutoencoderKL
        from transformers import CLIPTextModelWithProjection, PreTrainedTokenizerFast

        path = Path(path)
        index = json.loads((path / "model_index.json").read_text())
        if index.get("_class_name") != ARCHITECTURE:
            raise ValueError(f"{path} is not a {ARCHITECTURE} folder")
        text_encoder = CLIPTextModelWithProjection.from_pretrained(
            path / "text_encoder", dtype=torch.float32
        )
        vae = None
        if index.get("vae"):  # float32, as the rollout adapter's pipeline loads it
            vae = AutoencoderKL.from_pretrained(path, subfolder="vae", dtype=torch.float32)
            vae.requires_grad_(False).eval().to(device)
        pipeline = ShapesT2IPipeline(
            transformer=None,
            scheduler=None,
            text_encoder=text_encoder.to(device).eval(),
            tokenizer=PreTrainedTokenizerFast.from_pretrained(path / "tokenizer"),
            vae=vae,
        )
        return cls(pipeline, device=device)

    def conditioning(self, texts: list[str], *, do_cfg: bool, negative_prompt: str):
        return encode_shapes_prompts(
            self.pipeline, texts, do_cfg=do_cfg, negative_prompt=negative_prompt
        )

    @torch.no_grad()
    def encode_images(self, images: Tensor) -> Tensor:
        return self.pipeline.images_to_latents(images.cpu()).to(torch.float32).cpu()
