"""Sample encoders (the offline preference mode's prompts -> conditioning, images -> x0): the
conditioning is byte-identical to what the rollout adapter records, and image encoding inverts
the rollout's decoding (exactly in pixel space; with the VAE's scaling undone for SD3 and for a
latent ShapesT2I model)."""

from __future__ import annotations

import pytest
import torch

from omnirl.models.registry import get_rollout_adapter, get_training_adapter
from omnirl.protocol.messages import PromptSpec, SamplingParams

pytestmark = pytest.mark.usefixtures("torch_one_thread")
FIELDS = (
    "prompt_embeds",
    "pooled_prompt_embeds",
    "negative_prompt_embeds",
    "negative_pooled_prompt_embeds",
)


def _rollout_conditioning(rollout, texts, guidance_scale, size=32):
    sampling = SamplingParams(
        group_size=1,
        num_steps=1,
        guidance_scale=guidance_scale,
        height=size,
        width=size,
        sde_type="ode",
        negative_prompt="blurry",
        record_images=False,
    )
    prompts = [PromptSpec(group_id=f"g{i}", text=t) for i, t in enumerate(texts)]
    groups = rollout.sample(prompts, sampling, lease_id="l", worker_id="w", policy_version=0)
    return [{f: getattr(g, f) for f in FIELDS if getattr(g, f) is not None} for g in groups]


@pytest.mark.parametrize(
    ("fixture", "arch"),
    [
        ("tiny_shapes_path", "ShapesT2IPipeline"),
        ("tiny_shapes_latent_path", "ShapesT2IPipeline"),
        ("tiny_sd3_path", "StableDiffusion3Pipeline"),
    ],
)
@pytest.mark.parametrize("guidance_scale", [1.0, 3.0])
def test_prompts_encode_exactly_as_the_rollout_records_them(request, fixture, arch, guidance_scale):
    path = request.getfixturevalue(fixture)
    texts = ["a photo of a red circle", "a photo of two squares"]
    trainer = get_training_adapter(arch, "diffusion_dpo").from_pretrained(path, lora={"r": 2})
    encoder = trainer.sample_encoder()
    rows = encoder.encode_prompts(texts, guidance_scale=guidance_scale, negative_prompt="blurry")
    expected = _rollout_conditioning(
        get_rollout_adapter(arch, "diffusion_dpo").from_pretrained(path), texts, guidance_scale
    )
    assert len(rows) == 2
    for got, want in zip(rows, expected, strict=True):
        assert set(got) == set(want)  # negatives present iff guidance_scale > 1
        assert ("negative_prompt_embeds" in got) == (guidance_scale > 1)
        for name in want:
            assert torch.equal(got[name], want[name]), name


def test_shapes_images_round_trip_bit_for_bit(tiny_shapes_path):
    from omnirl.models.shapes_t2i import decode_images

    trainer = get_training_adapter("ShapesT2IPipeline", "diffusion_dpo").from_pretrained(
        tiny_shapes_path, lora={"r": 2}
    )
    images = torch.randint(0, 256, (3, 32, 32, 3), dtype=torch.uint8)
    latents = trainer.sample_encoder().encode_images(images)
    assert latents.shape == (3, 3, 32, 32) and latents.dtype == torch.float32
    assert float(latents.min()) >= -1.0 and float(latents.max()) <= 1.0
    assert torch.equal(decode_images(latents), images)
    assert trainer.sample_encoder().pipeline.vae is None  # a pixel model loads no VAE


def test_shapes_latent_images_encode_into_the_models_latent_space(tiny_shapes_latent_path):
    """A latent ShapesT2I model (preset ``tiny_latent``): images become its scaled 4x8x8 VAE
    latents, the shape its rollouts record as ``final_latents``, deterministically (the
    posterior mean), equal to the rollout pipeline's own ``images_to_latents``; and the
    rollout's ``_decode`` of them equals decoding the VAE's unscaled posterior mean, i.e.
    encode's ``(z - shift) * scale`` and decode's ``z / scale + shift`` are inverse. (The
    VAE is random, so decode(encode(x)) is not close to x; a trained one's round trip is
    scored in ``shapes_vae.roundtrip_accuracy``.)"""
    path = tiny_shapes_latent_path
    trainer = get_training_adapter("ShapesT2IPipeline", "diffusion_dpo").from_pretrained(
        path, lora={"r": 2}
    )
    encoder = trainer.sample_encoder()
    vae = encoder.pipeline.vae
    assert vae is not None and encoder.pipeline.transformer is None
    assert vae.config.scaling_factor == 1.7 and vae.config.shift_factor == 0.1
    images = torch.randint(0, 256, (3, 32, 32, 3), dtype=torch.uint8)
    latents = encoder.encode_images(images)
    assert latents.shape == (3, 4, 8, 8) and latents.dtype == torch.float32
    assert latents.device.type == "cpu" and not latents.requires_grad
    assert torch.equal(encoder.encode_images(images), latents)  # the mean, not a sample

    rollout = get_rollout_adapter("ShapesT2IPipeline", "diffusion_dpo").from_pretrained(path)
    with torch.no_grad():
        assert torch.equal(rollout.pipeline.images_to_latents(images), latents)
        x = images.permute(0, 3, 1, 2).float() / 127.5 - 1.0
        z = vae.encode(x).latent_dist.mode()
        direct = vae.decode(z, return_dict=False)[0]
        direct = ((direct + 1.0) * 127.5).clamp(0, 255).round().to(torch.uint8)
        via_latents = rollout._decode(latents)
    assert via_latents.shape == images.shape and via_latents.dtype == torch.uint8
    diff = (via_latents.int() - direct.permute(0, 2, 3, 1).int()).abs()
    assert int(diff.max()) <= 1  # float rounding of the scale / unscale only

    sampling = SamplingParams(
        group_size=2, num_steps=2, guidance_scale=1.0, height=32, width=32, sde_type="ode"
    )
    (group,) = rollout.sample(
        [PromptSpec(group_id="g", text="a photo of a red circle")],
        sampling,
        lease_id="l",
        worker_id="w",
        policy_version=0,
    )
    assert group.final_latents.shape[1:] == latents.shape[1:]
    assert group.final_latents.dtype == latents.dtype


def test_sd3_image_encoding_undoes_the_decoder_scaling(tiny_sd3_path):
    """rollout._decode(encode(x)) must equal decoding the VAE's own posterior mean of x with
    no scaling at all: only then are encode's (z - shift) * scale and decode's
    z / scale + shift inverse (the tiny VAE has scale 1.53, shift 0.06)."""
    trainer = get_training_adapter("StableDiffusion3Pipeline", "diffusion_dpo").from_pretrained(
        tiny_sd3_path, lora={"r": 2}
    )
    encoder = trainer.sample_encoder()
    vae = encoder.pipeline.vae
    assert vae.config.scaling_factor != 1.0 and vae.config.shift_factor
    assert getattr(encoder.pipeline, "transformer", None) is None  # encoders only
    images = torch.randint(0, 256, (2, 32, 32, 3), dtype=torch.uint8)
    latents = encoder.encode_images(images)
    assert latents.shape == (2, 16, 16, 16) and latents.dtype == torch.float32
    assert torch.equal(encoder.encode_images(images), latents)  # the mean, not a sample
    rollout = get_rollout_adapter("StableDiffusion3Pipeline", "diffusion_dpo").from_pretrained(
        tiny_sd3_path
    )
    with torch.no_grad():
        x = images.permute(0, 3, 1, 2).float() / 127.5 - 1.0
        z = vae.encode(x).latent_dist.mode()
        direct = vae.decode(z, return_dict=False)[0]
        direct = ((direct / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)
        via_latents = rollout._decode(latents)
    diff = (via_latents.int() - direct.permute(0, 2, 3, 1).int()).abs()
    assert int(diff.max()) <= 1  # float rounding of the scale / unscale only
