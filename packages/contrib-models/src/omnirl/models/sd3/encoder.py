"""SD3 prompt and image encoding, shared by the rollout adapter and the trainer's offline modes.

The rollout adapter encodes prompts with :func:`encode_sd3_prompts` and decodes latents with
:func:`vae_decode`; :class:`SD3SampleEncoder` (text encoders and VAE, no transformer) encodes
prompts with the same function and images with :func:`vae_encode`, the inverse of the
decoder's scaling, so a preference file's images become the clean latents ``x0`` a rollout
of this family would have produced for them (up to the autoencoder's own error).

Shapes: ``B`` rows, ``H, W`` pixels, ``C, h, w`` latent dims.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from omnirl.models.base import SampleEncoder
from omnirl.models.compile import CompileConfig, compile_module
from omnirl.models.sd3.step import SD3Conditioning

CONDITIONING_FIELDS = (
    "prompt_embeds",
    "pooled_prompt_embeds",
    "negative_prompt_embeds",
    "negative_pooled_prompt_embeds",
)


def default_max_sequence_length(pipeline) -> int:
    """The pipeline's 256 T5 tokens, or fewer when its T5 tokenizer is shorter."""
    t5 = getattr(pipeline, "tokenizer_3", None)
    return min(256, t5.model_max_length) if t5 is not None else 256


def encode_sd3_prompts(
    pipeline,
    texts: list[str],
    *,
    device: torch.device,
    do_cfg: bool,
    negative_prompt: str,
    max_sequence_length: int,
) -> SD3Conditioning:
    """``StableDiffusion3Pipeline.encode_prompt`` (CLIP x2 + T5), negatives iff ``do_cfg``."""
    pe, npe, pooled, npooled = pipeline.encode_prompt(
        prompt=texts,
        prompt_2=None,
        prompt_3=None,
        device=device,
        num_images_per_prompt=1,
        do_classifier_free_guidance=do_cfg,
        negative_prompt=[negative_prompt] * len(texts) if do_cfg else None,
        max_sequence_length=max_sequence_length,
    )
    if not do_cfg:
        npe = npooled = None
    return SD3Conditioning(pe, pooled, npe, npooled)


def conditioning_rows(cond: SD3Conditioning) -> list[dict[str, Tensor]]:
    """Per prompt, the group fields of its conditioning (CPU copies; absent negatives left out)."""
    rows = []
    for j in range(int(cond.prompt_embeds.shape[0])):
        row = {}
        for name in CONDITIONING_FIELDS:
            value = getattr(cond, name)
            if value is not None:
                row[name] = value[j].detach().cpu().clone()
        rows.append(row)
    return rows


def vae_decode(vae, latents: Tensor) -> Tensor:
    """Float32 latents ``[B, C, h, w]`` -> uint8 images ``[B, H, W, 3]`` (CPU)."""
    z = latents / vae.config.scaling_factor + (vae.config.shift_factor or 0.0)
    image = vae.decode(z.to(vae.dtype), return_dict=False)[0].to(torch.float32)
    image = ((image / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)
    return image.permute(0, 2, 3, 1).contiguous().cpu()


def compile_vae_decoder(vae, config: CompileConfig) -> list[str]:
    """Compile ``vae.decoder`` whole, in place (``config.regional`` does not apply: it has no
    repeated blocks), for :func:`vae_decode`. Its convolutions then run in the layout inductor
    picks (channels last) with each GroupNorm and activation fused, where eager converts the
    layout around every convolution (``benchmarks/vae_decode_probe.py``). Never with CUDA
    graphs: a decode is a few large kernels, and its graph would share the denoiser's tree."""
    mode = None if config.cudagraphs else config.mode
    return compile_module(vae.decoder, config.replace(regional=False, mode=mode))


def vae_encode(vae, images: Tensor) -> Tensor:
    """uint8 images ``[B, H, W, 3]`` -> float32 latents ``[B, C, h, w]`` on the VAE's device.

    The posterior's mean (``latent_dist.mode()``), not a sample, so the same image always
    gives the same latent; then the inverse of :func:`vae_decode`'s scaling:
    ``(z - shift_factor) * scaling_factor``.
    """
    device = next(vae.parameters()).device
    x = images.to(device).permute(0, 3, 1, 2).to(torch.float32) / 127.5 - 1.0
    z = vae.encode(x.to(vae.dtype)).latent_dist.mode().to(torch.float32)
    return (z - (vae.config.shift_factor or 0.0)) * vae.config.scaling_factor


class SD3SampleEncoder(SampleEncoder):
    """The text encoders and the VAE of an SD3 folder (no transformer)."""

    def __init__(self, pipeline, *, device: torch.device | str, max_sequence_length=None):
        self.pipeline = pipeline
        self.device = torch.device(device)
        self.max_sequence_length = max_sequence_length or default_max_sequence_length(pipeline)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> SD3SampleEncoder:
        from diffusers import StableDiffusion3Pipeline

        pipe = StableDiffusion3Pipeline.from_pretrained(path, transformer=None, dtype=dtype)
        pipe.to(device)
        pipe.set_progress_bar_config(disable=True)
        return cls(pipe, device=device)

    def conditioning(self, texts: list[str], *, do_cfg: bool, negative_prompt: str):
        return encode_sd3_prompts(
            self.pipeline,
            texts,
            device=self.device,
            do_cfg=do_cfg,
            negative_prompt=negative_prompt,
            max_sequence_length=self.max_sequence_length,
        )

    @torch.no_grad()
    def encode_prompts(
        self, texts: list[str], *, guidance_scale: float, negative_prompt: str = ""
    ) -> list[dict[str, Tensor]]:
        do_cfg = guidance_scale > 1.0
        cond = self.conditioning(list(texts), do_cfg=do_cfg, negative_prompt=negative_prompt)
        return conditioning_rows(cond)

    @torch.no_grad()
    def encode_images(self, images: Tensor) -> Tensor:
        return vae_encode(self.pipeline.vae, images).cpu()
