"""The ShapesT2I model: an SD3 transformer over pixels or over the latents of a tiny VAE, with
a small jointly-trained CLIP text encoder and a word-level tokenizer.

A folder of this family is a diffusers-style pipeline folder::

    model_index.json      {"_class_name": "ShapesT2IPipeline", ...}  (the registry key)
    transformer/          diffusers SD3Transformer2DModel
    scheduler/            FlowMatchEulerDiscreteScheduler config
    text_encoder/         transformers CLIPTextModelWithProjection
    tokenizer/            transformers PreTrainedTokenizerFast (word level)
    vae/                  diffusers AutoencoderKL (latent models only)

Pixel space (no ``vae/``): "latents" are the image itself, ``[B, 3, H, W]`` float32 in
[-1, 1] (``pixel = 127.5 * (x + 1)``); decoding clamps and quantises to uint8. Latent space:
latents are ``[B, C, H / f, W / f]`` (``f = vae_scale_factor``), scaled like SD3's
(``z * scaling_factor`` after subtracting ``shift_factor``), decoded by the VAE. Why a latent
model exists at all: the SDE noise of an RL step lives in the latent, and REINFORCE's
gradient noise grows with its dimension (3,072 for 32x32 RGB pixels, 256 for a 4x8x8
latent); see docs/shapes_eval.md, "Reinforcement learning". The text
conditioning has SD3's shape: ``prompt_embeds`` ``[B, L, D]`` is the encoder's last hidden
state (``L = MAX_LENGTH`` tokens, padded), ``pooled_prompt_embeds`` ``[B, D']`` its
projected ``<eos>`` embedding.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from torch import Tensor

from omnirl.models.shapes_t2i.tokenizer import MAX_LENGTH, build_tokenizer

ARCHITECTURE = "ShapesT2IPipeline"
# 32x32 pixels, patch 2: 256 image tokens. Pixel space at this size needs no resolution
# shift (SD3's 3.0 is for 4096 latent tokens); shift 1 spaces the sigmas evenly.
DEFAULT_SHIFT = 1.0


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ShapesT2IConfig:
    """Sizes of a ShapesT2I model."""

    image_size: int = 32
    patch_size: int = 2
    num_layers: int = 4
    num_attention_heads: int = 4
    attention_head_dim: int = 24
    text_hidden: int = 64  # CLIP width == joint_attention_dim
    text_layers: int = 2
    text_heads: int = 2
    pooled_dim: int = 64  # CLIP projection width == pooled_projection_dim
    shift: float = DEFAULT_SHIFT
    latent_channels: int = 0  # 0: pixel space; else a VAE with this many latent channels
    vae_channels: tuple[int, ...] = (32, 64, 64)  # one block per entry: f = 2 ** (n - 1)

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.vae_channels) - 1) if self.latent_channels else 1


PRESETS: dict[str, ShapesT2IConfig] = {
    "base": ShapesT2IConfig(),
    # half the width: about 2x the CPU throughput of base (RL on a 2-core machine)
    "small": ShapesT2IConfig(attention_head_dim=16),
    # a 4 x 8 x 8 latent (f = 4), patch 1: 64 image tokens instead of 256
    "latent": ShapesT2IConfig(patch_size=1, latent_channels=4),
    "latent_small": ShapesT2IConfig(patch_size=1, latent_channels=4, attention_head_dim=16),
    # for tests: builds and runs in well under a second
    "tiny": ShapesT2IConfig(
        num_layers=1, num_attention_heads=2, attention_head_dim=8, text_hidden=16, pooled_dim=16
    ),
    "tiny_latent": ShapesT2IConfig(
        num_layers=1,
        num_attention_heads=2,
        attention_head_dim=8,
        text_hidden=16,
        pooled_dim=16,
        patch_size=1,
        latent_channels=4,
        vae_channels=(8, 16, 16),
    ),
}


class ShapesT2IPipeline:
    """The components of a ShapesT2I folder, and the two things a pipeline adds to them:
    prompt encoding and image decoding.

    Attributes mirror ``StableDiffusion3Pipeline`` where the SD3 adapters read them
    (``transformer``, ``scheduler``, ``vae_scale_factor``).
    """

    def __init__(self, *, transformer, scheduler, text_encoder, tokenizer, vae=None):
        self.transformer = transformer
        self.scheduler = scheduler
        self.text_encoder = text_encoder
        self.tokenizer = tokenizer
        self.vae = vae  # None: pixel space

    @property
    def vae_scale_factor(self) -> int:
        if self.vae is None:
            return 1
        return 2 ** (len(self.vae.config.block_out_channels) - 1)

    @classmethod
    def from_pretrained(
        cls, path: str | Path, *, dtype: torch.dtype = torch.float32
    ) -> ShapesT2IPipeline:
        """Load a folder written by :meth:`save_pretrained`; only the transformer takes
        ``dtype`` (the text encoder stays float32: its embeddings feed float32 records)."""
        from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
        from transformers import CLIPTextModelWithProjection, PreTrainedTokenizerFast

        path = Path(path)
        index = json.loads((path / "model_index.json").read_text())
        if index.get("_class_name") != ARCHITECTURE:
            raise ValueError(
                f"{path} is not a {ARCHITECTURE} folder (_class_name={index.get('_class_name')!r})"
            )
        vae = None
        if index.get("vae"):  # float32 whatever the transformer's dtype: it is small
            vae = AutoencoderKL.from_pretrained(path, subfolder="vae", dtype=torch.float32)
            vae.requires_grad_(False).eval()
        return cls(
            vae=vae,
            transformer=SD3Transformer2DModel.from_pretrained(
                path, subfolder="transformer", dtype=dtype
            ),
            scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(path, subfolder="scheduler"),
            text_encoder=CLIPTextModelWithProjection.from_pretrained(
                path / "text_encoder", dtype=torch.float32
            ),
            tokenizer=PreTrainedTokenizerFast.from_pretrained(path / "tokenizer"),
        )

    def save_pretrained(self, path: str | Path) -> Path:
        """Write the folder (safetensors weights, configs, tokenizer, ``model_index.json``)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.transformer.save_pretrained(path / "transformer", safe_serialization=True)
        self.scheduler.save_pretrained(path / "scheduler")
        self.text_encoder.save_pretrained(path / "text_encoder", safe_serialization=True)
        self.tokenizer.save_pretrained(path / "tokenizer")
        if self.vae is not None:
            self.vae.save_pretrained(path / "vae", safe_serialization=True)
        index = {
            "_class_name": ARCHITECTURE,
            "_diffusers_version": _diffusers_version(),
            "transformer": ["diffusers", "SD3Transformer2DModel"],
            "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
            "text_encoder": ["transformers", "CLIPTextModelWithProjection"],
            "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
        }
        if self.vae is not None:
            index["vae"] = ["diffusers", "AutoencoderKL"]
        (path / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
        return path

    def to(self, device: torch.device | str) -> ShapesT2IPipeline:
        self.transformer.to(device)
        self.text_encoder.to(device)
        if self.vae is not None:
            self.vae.to(device)
        return self

    @property
    def device(self) -> torch.device:
        return next(self.text_encoder.parameters()).device

    def tokenize(self, texts: list[str]) -> Tensor:
        """Token ids int64 ``[B, MAX_LENGTH]`` (``<bos> words <eos> <pad>...``)."""
        enc = self.tokenizer(
            list(texts),
            padding="max_length",
            max_length=MAX_LENGTH,
            truncation=True,
            return_tensors="pt",
        )
        return enc["input_ids"].to(self.device)

    def encode_ids(self, input_ids: Tensor) -> tuple[Tensor, Tensor]:
        """``(prompt_embeds [B, L, D], pooled_prompt_embeds [B, D'])`` float32 from ids
        ``[B, L]``; differentiable (the pretraining tool trains the encoder through it)."""
        out = self.text_encoder(input_ids=input_ids, output_hidden_states=False)
        return out.last_hidden_state.to(torch.float32), out.text_embeds.to(torch.float32)

    def encode(self, texts: list[str]) -> tuple[Tensor, Tensor]:
        return self.encode_ids(self.tokenize(texts))

    def images_to_latents(self, images: Tensor) -> Tensor:
        """uint8 ``[B, H, W, 3]`` -> the model's clean latents float32 (pixels ``[B, 3, H, W]``
        in [-1, 1], or the VAE's scaled posterior mean ``[B, C, H / f, W / f]``)."""
        x = encode_images(images).to(self.device)
        if self.vae is None:
            return x
        z = self.vae.encode(x).latent_dist.mode()
        cfg = self.vae.config
        return (z - (cfg.shift_factor or 0.0)) * cfg.scaling_factor

    def latents_to_images(self, latents: Tensor) -> Tensor:
        """The inverse: latents -> uint8 ``[B, H, W, 3]`` on the CPU."""
        if self.vae is None:
            return decode_images(latents)
        cfg = self.vae.config
        z = latents.to(torch.float32) / cfg.scaling_factor + (cfg.shift_factor or 0.0)
        return decode_images(self.vae.decode(z, return_dict=False)[0])


def decode_images(latents: Tensor) -> Tensor:
    """Pixel-space latents float32 ``[B, 3, H, W]`` in [-1, 1] -> uint8 ``[B, H, W, 3]`` (CPU)."""
    image = ((latents.to(torch.float32) + 1.0) * 127.5).clamp(0, 255).round().to(torch.uint8)
    return image.permute(0, 2, 3, 1).contiguous().cpu()


def encode_images(images: Tensor) -> Tensor:
    """uint8 ``[B, H, W, 3]`` -> float32 ``[B, 3, H, W]`` in [-1, 1] (the inverse of decode)."""
    return images.permute(0, 3, 1, 2).to(torch.float32) / 127.5 - 1.0


def _diffusers_version() -> str:
    import diffusers

    return diffusers.__version__


def build_pipeline(
    words: list[str], config: ShapesT2IConfig | None = None, *, seed: int = 0
) -> ShapesT2IPipeline:
    """A randomly initialised ShapesT2I pipeline (weights a function of ``seed``).

    ``words``: the tokenizer's vocabulary (every word of the prompt grammar).
    """
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    cfg = config or PRESETS["base"]
    f = cfg.vae_scale_factor
    if cfg.image_size % (f * cfg.patch_size):
        raise ValueError(
            f"image_size {cfg.image_size} is not a multiple of the VAE factor {f} x patch_size"
        )
    sample_size = cfg.image_size // f
    channels = cfg.latent_channels or 3
    tokenizer = build_tokenizer(words)
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        text_encoder = CLIPTextModelWithProjection(
            CLIPTextConfig(
                vocab_size=len(tokenizer),
                hidden_size=cfg.text_hidden,
                intermediate_size=2 * cfg.text_hidden,
                projection_dim=cfg.pooled_dim,
                num_hidden_layers=cfg.text_layers,
                num_attention_heads=cfg.text_heads,
                max_position_embeddings=MAX_LENGTH,
                pad_token_id=tokenizer.pad_token_id,
                bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id,  # pooled = the first <eos> position
                hidden_act="gelu",
            )
        )
        vae = None
        if cfg.latent_channels:
            n = len(cfg.vae_channels)
            vae = AutoencoderKL(
                in_channels=3,
                out_channels=3,
                latent_channels=cfg.latent_channels,
                down_block_types=("DownEncoderBlock2D",) * n,
                up_block_types=("UpDecoderBlock2D",) * n,
                block_out_channels=tuple(cfg.vae_channels),
                layers_per_block=1,
                norm_num_groups=min(8, *cfg.vae_channels),
                sample_size=cfg.image_size,
                scaling_factor=1.0,  # set from the data once the VAE is trained
                shift_factor=0.0,
            )
        transformer = SD3Transformer2DModel(
            sample_size=sample_size,
            patch_size=cfg.patch_size,
            in_channels=channels,
            out_channels=channels,
            num_layers=cfg.num_layers,
            attention_head_dim=cfg.attention_head_dim,
            num_attention_heads=cfg.num_attention_heads,
            joint_attention_dim=cfg.text_hidden,
            caption_projection_dim=cfg.inner_dim,
            pooled_projection_dim=cfg.pooled_dim,
            pos_embed_max_size=sample_size // cfg.patch_size,
        )
    finally:
        torch.random.set_rng_state(state)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=cfg.shift)
    return ShapesT2IPipeline(
        transformer=transformer,
        scheduler=scheduler,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        vae=vae,
    )
