"""The first stage of pretraining a latent ShapesT2I model: its tiny VAE.

``train_vae`` fits the pipeline's ``AutoencoderKL`` on renders of train prompts (L1
reconstruction plus a small KL term, as latent diffusion autoencoders are trained, without
the adversarial loss: flat-coloured shapes need none), then freezes it and sets
``scaling_factor`` / ``shift_factor`` from the latents of fresh renders so that scaled
latents have zero mean and unit variance (SD3's convention: ``z_scaled = (z - shift) *
scale``). ``roundtrip_accuracy`` scores decode(encode(render)) with the ShapesEval detector:
a VAE that loses shapes or colours caps every model built on it, so its strict accuracy
should be close to the renders' own (1.0).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import numpy as np
import torch

from omnirl.models.shapes_t2i import ShapesT2IPipeline, encode_images


def train_vae(
    pipe: ShapesT2IPipeline,
    batches: Iterator[tuple[list[str], torch.Tensor]],
    *,
    minutes: float,
    lr: float = 1e-3,
    kl_weight: float = 1e-6,
    log: Callable[[dict], None] = print,
    log_every: int = 200,
) -> dict:
    """Train ``pipe.vae`` for ``minutes`` on ``batches`` (texts, uint8 ``[B, 32, 32, 3]``),
    then freeze it and fit its latent scaling. Returns the last log row."""
    vae = pipe.vae
    if vae is None:
        raise ValueError("the pipeline has no VAE (a pixel-space preset)")
    dev = next(vae.parameters()).device
    vae.requires_grad_(True).train()
    opt = torch.optim.AdamW(vae.parameters(), lr=lr, weight_decay=0.0)
    t0 = time.perf_counter()
    step, l1_sum, kl_sum, row = 0, 0.0, 0.0, {}
    while time.perf_counter() - t0 < minutes * 60:
        _, images = next(batches)
        x = encode_images(images).to(dev)  # float32 [B, 3, H, W] in [-1, 1]
        posterior = vae.encode(x).latent_dist
        recon = vae.decode(posterior.sample(), return_dict=False)[0]
        l1 = (recon - x).abs().mean()
        kl = posterior.kl().mean() / x[0].numel()
        loss = l1 + kl_weight * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        step += 1
        l1_sum += l1.item()
        kl_sum += kl.item()
        if step % log_every == 0:
            row = {
                "event": "vae",
                "step": step,
                "l1": round(l1_sum / log_every, 5),
                "kl_per_dim": round(kl_sum / log_every, 5),
                "minutes": round((time.perf_counter() - t0) / 60, 2),
            }
            log(row)
            l1_sum = kl_sum = 0.0
    vae.requires_grad_(False).eval()
    scale, shift = fit_latent_scaling(pipe, batches)
    row = {"event": "vae_done", "steps": step, "scaling_factor": scale, "shift_factor": shift}
    log(row)
    return row


@torch.no_grad()
def fit_latent_scaling(
    pipe: ShapesT2IPipeline, batches: Iterator, *, num_batches: int = 8
) -> tuple[float, float]:
    """Set and return ``(scaling_factor, shift_factor)`` = (1 / std, mean) of the posterior
    means of ``num_batches`` fresh batches."""
    vae = pipe.vae
    dev = next(vae.parameters()).device
    zs = [
        vae.encode(encode_images(next(batches)[1]).to(dev)).latent_dist.mode().flatten()
        for _ in range(num_batches)
    ]
    z = torch.cat(zs).double()
    shift, scale = float(z.mean()), float(1.0 / z.std().clamp(min=1e-6))
    vae.register_to_config(scaling_factor=scale, shift_factor=shift)
    return scale, shift


@torch.no_grad()
def roundtrip_accuracy(pipe: ShapesT2IPipeline, specs: list, *, seed: int = 0) -> float:
    """Strict accuracy of decode(encode(render)) over ``specs`` (one render each)."""
    from omnirl.reward.shapes import render_batch, score_batch

    images = torch.from_numpy(render_batch(specs, 32, list(range(seed, seed + len(specs)))))
    back = pipe.latents_to_images(pipe.images_to_latents(images)).numpy()
    return float(np.mean([score_batch(back[i : i + 1], s)[0].strict for i, s in enumerate(specs)]))
