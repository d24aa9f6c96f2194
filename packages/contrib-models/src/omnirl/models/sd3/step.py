"""The one SD3 denoising step both adapters run: schedule, CFG velocity, SDE step.

The rollout samples with :func:`sd3_step` and the trainer recomputes log-probs with the same
function, so the guided mean cannot diverge between them. Everything the scheduler touches is
float32; only the transformer call sees the model dtype.

Shapes: ``B`` samples, ``C, H, W`` latent dims, ``L`` text tokens, ``D`` joint-attention
width, ``D'`` pooled width.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from omnirl.models.device import model_autocast
from omnirl.models.schedulers import FlowMatchSDEScheduler, SDEStepOutput
from omnirl.models.transitions import SharedInputs


@dataclasses.dataclass(frozen=True, slots=True)
class SD3Conditioning:
    """Per-row text conditioning; negatives present iff classifier-free guidance is on."""

    prompt_embeds: Tensor  # [B, L, D]
    pooled_prompt_embeds: Tensor  # [B, D']
    negative_prompt_embeds: Tensor | None = None  # [B, L, D]
    negative_pooled_prompt_embeds: Tensor | None = None  # [B, D']

    @property
    def do_cfg(self) -> bool:
        return self.negative_prompt_embeds is not None

    def index_select(self, rows: Tensor) -> SD3Conditioning:
        """Rows ``rows`` (int64 ``[B']``) of every field, e.g. prompts expanded to samples."""
        return SD3Conditioning(
            **{
                f.name: None if (t := getattr(self, f.name)) is None else t.index_select(0, rows)
                for f in dataclasses.fields(self)
            }
        )


def _calculate_shift(seq_len: int, config) -> float:
    """diffusers' resolution-dependent shift ``mu`` (only for ``use_dynamic_shifting``)."""
    base_len = config.get("base_image_seq_len", 256)
    max_len = config.get("max_image_seq_len", 4096)
    base_shift = config.get("base_shift", 0.5)
    max_shift = config.get("max_shift", 1.16)
    slope = (max_shift - base_shift) / (max_len - base_len)
    return seq_len * slope + base_shift - slope * base_len


def set_schedule(
    scheduler: FlowMatchSDEScheduler,
    num_steps: int,
    latent_hw: tuple[int, int],
    patch_size: int,
    device: torch.device | str,
) -> tuple[Tensor, Tensor]:
    """Set the sampling schedule as ``StableDiffusion3Pipeline`` does.

    Returns ``timesteps`` float32 ``[T]`` (sigma * 1000) and ``sigmas`` float32 ``[T+1]``
    (terminal 0), both on ``device``.
    """
    kwargs = {}
    if scheduler.config.get("use_dynamic_shifting", False):
        seq_len = (latent_hw[0] // patch_size) * (latent_hw[1] // patch_size)
        kwargs["mu"] = _calculate_shift(seq_len, scheduler.config)
    scheduler.set_timesteps(num_steps, device=device, **kwargs)
    timesteps = scheduler.timesteps.to(device=device, dtype=torch.float32)
    sigmas = scheduler.sigmas.to(device=device, dtype=torch.float32)
    return timesteps, sigmas


def guided_velocity(
    transformer: torch.nn.Module,
    latents: Tensor,
    timesteps: Tensor,
    cond: SD3Conditioning,
    guidance_scale: float,
    *,
    model_dtype: torch.dtype | None = None,
    shared: SharedInputs | None = None,
) -> Tensor:
    """The (classifier-free guided) velocity ``v`` float32 ``[B, C, H, W]``.

    ``latents`` float32 ``[B, C, H, W]``, ``timesteps`` float32 ``[B]``. With CFG the
    unconditional and conditional rows go through one forward of ``2B`` rows (unconditional
    first, as diffusers does) and combine in float32: ``v_u + s * (v_c - v_u)``.
    ``model_dtype``: the dtype inputs are cast to (default ``transformer.dtype``, which walks
    the module tree on every call; adapters pass it cached). A half-precision model runs
    under autocast to that dtype (:func:`omnirl.models.device.model_autocast`).
    ``shared``: rows with identical inputs; the transformer runs on ``shared.first`` only and
    its velocity is expanded back to ``[B]`` rows (same values, same gradients).
    """
    if shared is not None:
        v = guided_velocity(
            transformer,
            latents.index_select(0, shared.first),
            timesteps.index_select(0, shared.first),
            cond.index_select(shared.first),
            guidance_scale,
            model_dtype=model_dtype,
        )
        return v.index_select(0, shared.inverse)
    dtype = model_dtype if model_dtype is not None else transformer.dtype
    if cond.do_cfg:
        hidden = torch.cat([latents, latents])
        t = torch.cat([timesteps, timesteps])
        text = torch.cat([cond.negative_prompt_embeds, cond.prompt_embeds])
        pooled = torch.cat([cond.negative_pooled_prompt_embeds, cond.pooled_prompt_embeds])
    else:
        hidden, t, text, pooled = latents, timesteps, cond.prompt_embeds, cond.pooled_prompt_embeds
    with model_autocast(hidden.device.type, dtype):  # half models: LoRA at the model dtype
        out = transformer(
            hidden_states=hidden.to(dtype),
            timestep=t,
            encoder_hidden_states=text.to(dtype),
            pooled_projections=pooled.to(dtype),
            return_dict=False,
        )[0]
    out = out.to(torch.float32)
    if not cond.do_cfg:
        return out
    v_uncond, v_cond = out.chunk(2)
    return v_uncond + guidance_scale * (v_cond - v_uncond)


def sd3_step(
    transformer: torch.nn.Module,
    scheduler: FlowMatchSDEScheduler,
    latents: Tensor,
    timesteps: Tensor,
    sigmas: Tensor,
    next_sigmas: Tensor,
    cond: SD3Conditioning,
    guidance_scale: float,
    *,
    sde_type: str,
    noise_level: float | Tensor,
    sigma_max: float,
    noise: Tensor | None = None,
    prev_sample: Tensor | None = None,
    model_dtype: torch.dtype | None = None,
    shared: SharedInputs | None = None,
) -> SDEStepOutput:
    """One transition ``x(sigma) -> x(sigma_next)`` with its log-prob (see ``sde_step``).

    ``latents`` float32 ``[B, C, H, W]``; ``timesteps``, ``sigmas``, ``next_sigmas`` float32
    ``[B]``; ``noise`` (rollout) or ``prev_sample`` (trainer) float32 ``[B, C, H, W]``;
    ``sigma_max`` is the schedule's ``sigmas[1]`` (the ``sde`` variance at sigma = 1);
    ``shared``: rows whose model inputs are identical (see :func:`guided_velocity`).
    """
    velocity = guided_velocity(
        transformer,
        latents,
        timesteps,
        cond,
        guidance_scale,
        model_dtype=model_dtype,
        shared=shared,
    )
    return scheduler.sde_step(
        velocity,
        latents,
        sigmas,
        next_sigmas,
        sde_type=sde_type,
        noise_level=noise_level,
        noise=noise,
        prev_sample=prev_sample,
        sigma_max=sigma_max,
    )
