"""The ShapesT2I model: a pixel-space SD3 transformer with a small jointly-trained CLIP text
encoder and a word-level tokenizer.

A folder of this family is a diffusers-style pipeline folder::

    model_index.json      {"_class_name": "ShapesT2IPipeline", ...}  (the registry key)
    transformer/          diffusers SD3Transformer2DModel (in_channels 3: RGB pixels)
    scheduler/            FlowMatchEulerDiscreteScheduler config
    text_encoder/         transformers CLIPTextModelWithProjection
    tokenizer/            transformers PreTrainedTokenizerFast (word level)

There is no VAE: "latents" are the image itself, ``[B, 3, H, W]`` float32 in [-1, 1]
(``pixel = 127.5 * (x + 1)``); decoding clamps and quantises to uint8. The text
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

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim


PRESETS: dict[str, ShapesT2IConfig] = {
    "base": ShapesT2IConfig(),
    # half the width: about 2x the CPU throughput of base (RL on a 2-core machine)
    "small": ShapesT2IConfig(attention_head_dim=16),
    # for tests: builds and runs in well under a second
    "tiny": ShapesT2IConfig(
        num_layers=1, num_attention_heads=2, attention_head_dim=8, text_hidden=16, pooled_dim=16
    ),
}


class ShapesT2IPipeline:
    """The components of a ShapesT2I folder, and the two things a pipeline adds to them:
    prompt encoding and image decoding.

    Attributes mirror ``StableDiffusion3Pipeline`` where the SD3 adapters read them
    (``transformer``, ``scheduler``, ``vae_scale_factor``).
    """

    vae_scale_factor = 1  # pixel space

    def __init__(self, *, transformer, scheduler, text_encoder, tokenizer):
        self.transformer = transformer
        self.scheduler = scheduler
        self.text_encoder = text_encoder
        self.tokenizer = tokenizer

    @classmethod
    def from_pretrained(
        cls, path: str | Path, *, dtype: torch.dtype = torch.float32
    ) -> ShapesT2IPipeline:
        """Load a folder written by :meth:`save_pretrained`; only the transformer takes
        ``dtype`` (the text encoder stays float32: its embeddings feed float32 records)."""
        from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
        from transformers import CLIPTextModelWithProjection, PreTrainedTokenizerFast

        path = Path(path)
        index = json.loads((path / "model_index.json").read_text())
        if index.get("_class_name") != ARCHITECTURE:
            raise ValueError(
                f"{path} is not a {ARCHITECTURE} folder (_class_name={index.get('_class_name')!r})"
            )
        return cls(
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
        index = {
            "_class_name": ARCHITECTURE,
            "_diffusers_version": _diffusers_version(),
            "transformer": ["diffusers", "SD3Transformer2DModel"],
            "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
            "text_encoder": ["transformers", "CLIPTextModelWithProjection"],
            "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
        }
        (path / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
        return path

    def to(self, device: torch.device | str) -> ShapesT2IPipeline:
        self.transformer.to(device)
        self.text_encoder.to(device)
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
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    cfg = config or PRESETS["base"]
    if cfg.image_size % cfg.patch_size:
        raise ValueError(f"image_size {cfg.image_size} is not a multiple of patch_size")
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
        transformer = SD3Transformer2DModel(
            sample_size=cfg.image_size,
            patch_size=cfg.patch_size,
            in_channels=3,
            out_channels=3,
            num_layers=cfg.num_layers,
            attention_head_dim=cfg.attention_head_dim,
            num_attention_heads=cfg.num_attention_heads,
            joint_attention_dim=cfg.text_hidden,
            caption_projection_dim=cfg.inner_dim,
            pooled_projection_dim=cfg.pooled_dim,
            pos_embed_max_size=cfg.image_size // cfg.patch_size,
        )
    finally:
        torch.random.set_rng_state(state)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=cfg.shift)
    return ShapesT2IPipeline(
        transformer=transformer, scheduler=scheduler, text_encoder=text_encoder, tokenizer=tokenizer
    )
