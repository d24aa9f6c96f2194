"""The tiny random SD3 folder is a real diffusers checkpoint."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from omnirl.models.sd3.tiny import PRESETS, main, make_tiny_sd3

pytestmark = pytest.mark.usefixtures("torch_one_thread")


def test_tiny_loads_with_stable_diffusion3_pipeline(tiny_sd3_path):
    from diffusers import StableDiffusion3Pipeline

    size = sum(f.stat().st_size for f in tiny_sd3_path.rglob("*") if f.is_file())
    assert size < 2 * 2**20, size
    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_sd3_path)
    assert pipe.scheduler.config.shift == 3.0
    assert pipe.transformer.config.in_channels == 16
    assert pipe.vae.config.latent_channels == 16
    assert type(pipe.text_encoder_3).__name__ == "T5EncoderModel"
    pipe.set_progress_bar_config(disable=True)
    out = pipe(
        "a red cat",
        num_inference_steps=2,
        height=32,
        width=32,
        guidance_scale=4.5,
        max_sequence_length=16,
        output_type="np",
        generator=torch.Generator().manual_seed(0),
    )
    assert out.images.shape == (1, 32, 32, 3)
    ids = pipe.tokenizer("a red cat").input_ids
    assert ids[0] == pipe.tokenizer.bos_token_id and ids[-1] == pipe.tokenizer.eos_token_id
    assert pipe.tokenizer_3("a red cat").input_ids[-1] == pipe.tokenizer_3.eos_token_id


def test_tiny_is_deterministic_in_seed_and_cli_writes_it(tmp_path, tiny_sd3_path):
    main([str(tmp_path / "again"), "--seed", "0"])
    rel = "transformer/diffusion_pytorch_model.safetensors"
    a, b = load_file(tiny_sd3_path / rel), load_file(tmp_path / "again" / rel)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    other = load_file(make_tiny_sd3(tmp_path / "other", seed=1) / rel)
    assert not all(torch.equal(a[k], other[k]) for k in a)


def test_10m_preset_is_about_ten_million_parameters():
    from omnirl.models.sd3.tiny import _transformer

    n = sum(p.numel() for p in _transformer(PRESETS["10m"]).parameters())
    assert 8e6 < n < 12e6, n
