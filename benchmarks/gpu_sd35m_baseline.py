"""The baseline of ``gpu_sd35m.py``: a flow_grpo-style eager iteration, written here.

What a Flow-GRPO iteration on SD3 does (yifan123/flow_grpo ``scripts/train_sd3.py`` and its
``sd3_pipeline_with_logprob`` / ``sde_step_with_logprob``, read for what they compute; the
code below is ours): one model, LoRA on the attention projections, eager PyTorch under
bf16 autocast;

1. rollout: ``steps`` Euler-SDE steps with CFG (one forward of ``2B`` rows per step),
   recording every latent and the step's Gaussian log-prob (float32 step math);
2. VAE decode of the final latents;
3. training on the first ``steps - 1`` timesteps (``timestep_fraction`` 0.99): per
   micro-batch and timestep a CFG forward with gradients, the recorded transition's
   log-prob, a reference forward with the adapter disabled (the KL term, when
   ``kl_beta > 0``), PPO-clip loss, backward; one optimiser step per micro-batch after all
   of its timesteps (gradient accumulation over timesteps).

Shapes: ``B`` images, ``C, h, w`` latent dims, ``L`` text tokens, ``D`` text width.
"""

from __future__ import annotations

import contextlib
import math

import torch


def _autocast(device, dtype):
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=dtype)


def sde_step(
    v, x, sigma: float, sigma_next: float, sigma_max: float, a: float, *, prev=None, noise=None
):
    """Flow-GRPO's SDE step at scalar sigmas: ``(prev [B, ...], log_prob [B], mean, std_dev_t)``.

    ``v`` velocity, ``x`` latent (any dtype; the math is float32). ``prev`` given: its
    log-prob; else sampled with ``noise``.
    """
    v, x = v.float(), x.float()
    dt = sigma_next - sigma
    g = a * math.sqrt(sigma / (1 - (sigma_max if sigma == 1.0 else sigma)))
    mean = x * (1 + g * g / (2 * sigma) * dt) + v * (1 + g * g * (1 - sigma) / (2 * sigma)) * dt
    std = g * math.sqrt(-dt)
    if prev is None:
        prev = mean + std * noise
    prev = prev.float()
    lp = (
        -((prev.detach() - mean) ** 2) / (2 * std * std)
        - math.log(std)
        - 0.5 * math.log(2 * math.pi)
    )
    return prev, lp.mean(dim=tuple(range(1, lp.ndim))), mean, g


def cfg_velocity(model, x, t: float, pe, pooled, npe, npooled, guidance: float, dtype):
    """One forward of ``2B`` rows (unconditional first) and the guided velocity."""
    rows = x.shape[0]
    out = model(
        hidden_states=torch.cat([x, x]).to(dtype),
        timestep=torch.full((2 * rows,), t, device=x.device),
        encoder_hidden_states=torch.cat([npe, pe]),
        pooled_projections=torch.cat([npooled, pooled]),
        return_dict=False,
    )[0]
    uncond, cond = out.chunk(2)
    return uncond + guidance * (cond - uncond)


@torch.no_grad()
def rollout(model, sigmas: list[float], cond, setup, generator, dtype) -> dict:
    """``latents`` float32 ``[B, T+1, C, h, w]`` and ``log_probs`` ``[B, T]`` of ``B`` samples."""
    pe, pooled, npe, npooled = cond
    rows, dev = pe.shape[0], pe.device
    h = setup.side // 8
    x = torch.randn(rows, 16, h, h, device=dev, generator=generator)
    latents, logps = [x], []
    with _autocast(dev, dtype):
        for i in range(setup.steps):
            v = cfg_velocity(
                model, x, 1000 * sigmas[i], pe, pooled, npe, npooled, setup.guidance, dtype
            )
            noise = torch.randn(x.shape, device=dev, generator=generator)
            x, lp, _, _ = sde_step(
                v, x, sigmas[i], sigmas[i + 1], sigmas[1], setup.noise_level, noise=noise
            )
            latents.append(x)
            logps.append(lp)
    return {"latents": torch.stack(latents, 1), "log_probs": torch.stack(logps, 1)}


@torch.no_grad()
def decode(vae, latents):
    """float32 latents ``[B, C, h, w]`` -> uint8 images ``[B, H, W, 3]``."""
    z = latents / vae.config.scaling_factor + vae.config.shift_factor
    image = vae.decode(z.to(vae.dtype), return_dict=False)[0].float()
    return ((image / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1)


def train(
    model,
    optimizer,
    traj: dict,
    advantages,
    sigmas: list[float],
    cond,
    setup,
    dtype,
    *,
    kl_beta: float,
    clip_range: float = 1e-4,
) -> float:
    """One pass over the samples: per micro-batch, every trained timestep, then one step."""
    pe, pooled, npe, npooled = cond
    rows = pe.shape[0]
    params = [p for p in model.parameters() if p.requires_grad]
    steps = setup.trained_steps
    total = torch.zeros((), device=pe.device)
    for start in range(0, rows, setup.micro):
        sl = slice(start, start + setup.micro)
        mcond = (pe[sl], pooled[sl], npe[sl], npooled[sl])
        for j in range(steps):
            x, prev = traj["latents"][sl, j], traj["latents"][sl, j + 1]
            with _autocast(pe.device, dtype):
                v = cfg_velocity(model, x, 1000 * sigmas[j], *mcond, setup.guidance, dtype)
                _, lp, mean, g = sde_step(
                    v, x, sigmas[j], sigmas[j + 1], sigmas[1], setup.noise_level, prev=prev
                )
                kl = torch.zeros((), device=pe.device)
                if kl_beta > 0:
                    with torch.no_grad():
                        model.disable_adapters()
                        try:
                            v_ref = cfg_velocity(
                                model, x, 1000 * sigmas[j], *mcond, setup.guidance, dtype
                            )
                        finally:
                            model.enable_adapters()
                        _, _, mean_ref, _ = sde_step(
                            v_ref,
                            x,
                            sigmas[j],
                            sigmas[j + 1],
                            sigmas[1],
                            setup.noise_level,
                            prev=prev,
                        )
                    kl = ((mean - mean_ref) ** 2).mean(dim=(1, 2, 3)).mean() / (2 * g * g)
            adv = advantages[sl].clamp(-5, 5)
            ratio = torch.exp(lp - traj["log_probs"][sl, j])
            clipped = torch.clamp(ratio, 1 - clip_range, 1 + clip_range)
            loss = torch.maximum(-adv * ratio, -adv * clipped).mean() + kl_beta * kl
            (loss / steps).backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return float(total)


def iteration(
    model, vae, optimizer, sigmas, cond, setup, generator, dtype, clock, times, *, kl_beta: float
) -> None:
    """Rollout, decode, advantages of random rewards, training; wall times into ``times``."""
    with clock(times, "rollout_s"):
        traj = rollout(model, sigmas, cond, setup, generator, dtype)
    with clock(times, "decode_s"):
        decode(vae, traj["latents"][:, -1])
    rewards = torch.rand(setup.prompts, setup.group, generator=generator, device=generator.device)
    adv = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std() + 1e-4)
    with clock(times, "train_s"):
        train(
            model,
            optimizer,
            traj,
            adv.reshape(-1).to(cond[0].device),
            sigmas,
            cond,
            setup,
            dtype,
            kl_beta=kl_beta,
        )


def make_optimizer(model) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=1e-4, weight_decay=1e-4)


def expand_cond(pipe, setup):
    """Per-image conditioning ``(pe [B, L, D], pooled [B, D'], npe, npooled)``."""
    texts = [f"prompt {i}" for i in range(setup.prompts)]
    pe, pooled = pipe.embed(texts)
    npe, npooled = pipe.embed([""] * setup.prompts)
    rep = lambda t: t.repeat_interleave(setup.group, 0)  # noqa: E731
    return rep(pe), rep(pooled), rep(npe), rep(npooled)
