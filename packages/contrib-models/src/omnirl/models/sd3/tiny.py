"""Write a tiny random Stable Diffusion 3 pipeline folder, built offline in code.

The folder is a real diffusers ``StableDiffusion3Pipeline`` checkpoint (``model_index.json``,
component configs, safetensors weights, two CLIP tokenizers and a T5 tokenizer whose
vocabularies are written here), so ``StableDiffusion3Pipeline.from_pretrained(path)`` loads
it from disk with no hub access. Weights are random: images are noise, but every shape,
dtype and code path is the real model's.

Presets (``size``):

- ``"tiny"``: transformer 2 layers, 2 heads x 16 (about 0.1 M parameters), the whole folder
  well under 2 MB; builds in about a second. Default image 32x32 (latents 16x16).
- ``"10m"``: transformer 4 layers, 4 heads x 64 (about 10 M parameters), for benchmarks.
  Default image 64x64 (latents 32x32).

Command line: ``python -m omnirl.models.sd3.tiny DIR [--size tiny|10m] [--seed N]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import string
from pathlib import Path

import torch

# Text sequence lengths of the tiny tokenizers (CLIP's 77 and T5's 256 in the real model).
CLIP_MAX_LENGTH = 16
T5_MAX_LENGTH = 16


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TinySD3Config:
    """Sizes of the tiny model's components."""

    num_layers: int = 2
    num_attention_heads: int = 2
    attention_head_dim: int = 16
    patch_size: int = 2
    latent_channels: int = 16
    sample_size: int = 16  # latent height/width the position embedding is built for
    clip_hidden: int = 16  # each CLIP: hidden width == projection width
    t5_hidden: int = 32  # == joint_attention_dim; >= 2 * clip_hidden (SD3 pads CLIP to it)
    vae_channels: tuple[int, ...] = (8, 8)  # two blocks: VAE scale factor 2
    # SD3.5's transformer features (SD3's off): blocks with an image-only second attention,
    # q/k normalisation ("rms_norm")
    dual_attention_layers: tuple[int, ...] = ()
    qk_norm: str | None = None

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim


PRESETS: dict[str, TinySD3Config] = {
    "tiny": TinySD3Config(),
    "10m": TinySD3Config(
        num_layers=4, num_attention_heads=4, attention_head_dim=64, sample_size=32, t5_hidden=64
    ),
}


def _clip_vocab() -> tuple[dict[str, int], list[str]]:
    """A character-level CLIP BPE vocabulary (no merges): every char, plain and word-final."""
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    chars = string.ascii_lowercase + string.digits + "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"
    for ch in chars:
        vocab[ch] = len(vocab)
        vocab[ch + "</w>"] = len(vocab)
    return vocab, []


def _t5_vocab() -> list[tuple[str, float]]:
    """A character-level T5 unigram vocabulary: <pad>=0, </s>=1, <unk>=2, then pieces."""
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    chars = string.ascii_letters + string.digits + string.punctuation
    pieces += [("▁" + ch, -3.0) for ch in chars]
    pieces += [(ch, -4.0) for ch in chars]
    return pieces


def build_tokenizers(clip_max_length: int = CLIP_MAX_LENGTH, t5_max_length: int = T5_MAX_LENGTH):
    """A character-level CLIP tokenizer and T5 tokenizer built in memory (no hub), padding
    to ``clip_max_length`` / ``t5_max_length`` tokens (the real SD3's are 77 and 256)."""
    from transformers import CLIPTokenizer, T5Tokenizer

    vocab, merges = _clip_vocab()
    clip = CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=clip_max_length)
    t5 = T5Tokenizer(vocab=_t5_vocab(), extra_ids=0, model_max_length=t5_max_length)
    return clip, t5


def _text_encoders(cfg: TinySD3Config, clip_vocab_size: int, t5_vocab_size: int):
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    def clip():
        config = CLIPTextConfig(
            vocab_size=clip_vocab_size,
            hidden_size=cfg.clip_hidden,
            intermediate_size=2 * cfg.clip_hidden,
            projection_dim=cfg.clip_hidden,
            num_hidden_layers=2,  # SD3 reads the penultimate hidden state
            num_attention_heads=2,
            max_position_embeddings=CLIP_MAX_LENGTH,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=1,
            hidden_act="gelu",
        )
        return CLIPTextModelWithProjection(config)

    t5_config = T5Config(
        vocab_size=t5_vocab_size,
        d_model=cfg.t5_hidden,
        d_kv=8,
        d_ff=2 * cfg.t5_hidden,
        num_layers=1,
        num_heads=2,
        relative_attention_num_buckets=8,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    return clip(), clip(), T5EncoderModel(t5_config)


def _transformer(cfg: TinySD3Config):
    from diffusers import SD3Transformer2DModel

    return SD3Transformer2DModel(
        sample_size=cfg.sample_size,
        patch_size=cfg.patch_size,
        in_channels=cfg.latent_channels,
        out_channels=cfg.latent_channels,
        num_layers=cfg.num_layers,
        attention_head_dim=cfg.attention_head_dim,
        num_attention_heads=cfg.num_attention_heads,
        joint_attention_dim=cfg.t5_hidden,
        caption_projection_dim=cfg.inner_dim,
        pooled_projection_dim=2 * cfg.clip_hidden,
        pos_embed_max_size=cfg.sample_size,
        dual_attention_layers=cfg.dual_attention_layers,
        qk_norm=cfg.qk_norm,
    )


def _vae(cfg: TinySD3Config):
    from diffusers import AutoencoderKL

    n = len(cfg.vae_channels)
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * n,
        up_block_types=("UpDecoderBlock2D",) * n,
        block_out_channels=cfg.vae_channels,
        layers_per_block=1,
        latent_channels=cfg.latent_channels,
        norm_num_groups=4,
        sample_size=cfg.sample_size * 2 ** (n - 1),
        scaling_factor=1.5305,  # SD3's values
        shift_factor=0.0609,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )


def make_tiny_sd3(
    path: str | Path, *, seed: int = 0, size: str = "tiny", config: TinySD3Config | None = None
) -> Path:
    """Write a tiny random ``StableDiffusion3Pipeline`` folder to ``path`` and return it.

    ``size`` picks a preset from :data:`PRESETS`; ``config`` overrides it. The weights are
    a deterministic function of ``seed``.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    if config is None:
        if size not in PRESETS:
            raise ValueError(f"unknown tiny SD3 size {size!r}; known: {sorted(PRESETS)}")
        config = PRESETS[size]
    if config.t5_hidden < 2 * config.clip_hidden:
        raise ValueError("t5_hidden must be >= 2 * clip_hidden (SD3 pads CLIP embeds to T5's)")
    path = Path(path)
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        clip_tok, t5_tok = build_tokenizers()
        te1, te2, te3 = _text_encoders(config, len(clip_tok), len(t5_tok))
        pipe = StableDiffusion3Pipeline(
            transformer=_transformer(config),
            scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
            vae=_vae(config),
            text_encoder=te1,
            tokenizer=clip_tok,
            text_encoder_2=te2,
            tokenizer_2=clip_tok,
            text_encoder_3=te3,
            tokenizer_3=t5_tok,
        )
    finally:
        torch.random.set_rng_state(generator_state)
    pipe.save_pretrained(path, safe_serialization=True)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write a tiny random SD3 pipeline folder.")
    parser.add_argument("path", help="output folder")
    parser.add_argument("--size", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = make_tiny_sd3(args.path, seed=args.seed, size=args.size)
    print(out)


if __name__ == "__main__":
    main()
