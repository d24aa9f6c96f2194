"""``FlowMatchSDEScheduler``: diffusers' flow-matching Euler scheduler plus SDE steps with
log-probs, computed in float32 from start to end.

The schedule (``set_timesteps``) is diffusers' own, unchanged. ``sde_step`` takes sigmas
explicitly (``[B]``, so one batch may mix steps, as the trainer's recomputation does) and
keeps no step counter. See ``docs/algorithms.md`` for every formula and its source.
"""

import math
from dataclasses import dataclass
from typing import Literal

import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.utils.torch_utils import randn_tensor

from omnirl.models.schedulers import sde_formulas, window
from omnirl.models.schedulers.errors import SchedulerInputError

SDEType = Literal["sde", "cps", "dance_sde", "ode"]
SDE_TYPES: tuple[str, ...] = ("sde", "cps", "dance_sde", "ode")
_LOG_SQRT_2PI = math.log(math.sqrt(2 * math.pi))


@dataclass(frozen=True, slots=True)
class SDEStepOutput:
    """One transition x(sigma) -> x(sigma_next), all float32.

    prev_sample:      [B, ...] the next latent (sampled, or the given ``prev_sample``)
    log_prob:         [B] log-density of ``prev_sample`` averaged over non-batch elements
                      (``cps``: its surrogate ``-mean((x' - mean)^2)``); 0 where the step is
                      deterministic (``ode``, noise level 0, or zero std)
    prev_sample_mean: [B, ...] the Gaussian's mean (what a KL to the reference compares)
    std_dev_t:        [B] the reference's ``std_dev_t`` (the KL term divides by its square);
                      ``sde``: excludes ``sqrt(-dt)``; ``cps``, ``dance_sde``: equals step_std
    step_std:         [B] the step's standard deviation (0 where deterministic)
    """

    prev_sample: torch.Tensor
    log_prob: torch.Tensor
    prev_sample_mean: torch.Tensor
    std_dev_t: torch.Tensor
    step_std: torch.Tensor


def _per_sample(
    value: float | torch.Tensor, batch: int, device: torch.device, name: str
) -> torch.Tensor:
    """A float or a 0-d / [1] / [B] tensor as float32 ``[B]`` on ``device``."""
    t = torch.as_tensor(value, dtype=torch.float32, device=device)
    if t.ndim > 1 or t.numel() not in (1, batch):
        raise SchedulerInputError(
            f"{name} must be a float or a [B] tensor with B={batch}, got shape {tuple(t.shape)}"
        )
    if not torch.isfinite(t).all():
        raise SchedulerInputError(f"{name} must be finite")
    return t.reshape(-1).expand(batch).contiguous()


def _require_fp32(t: torch.Tensor, name: str, shape: torch.Size) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise SchedulerInputError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dtype != torch.float32:
        raise SchedulerInputError(
            f"{name} must be float32 (got {t.dtype}); keep latents in float32 end to end, "
            "a lower precision copy changes the log-prob"
        )
    if t.shape != shape:
        raise SchedulerInputError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    return t


class FlowMatchSDEScheduler(FlowMatchEulerDiscreteScheduler):
    """diffusers' ``FlowMatchEulerDiscreteScheduler`` with ``sde`` / ``cps`` / ``dance_sde`` /
    ``ode`` steps that return log-probs. Build it with ``from_config(pipe.scheduler.config)``."""

    default_sde_sigma_max: float | None = None  # sigmas[1] of the last set_timesteps

    def set_timesteps(self, *args, **kwargs) -> None:
        """diffusers' ``set_timesteps`` (float32 sigmas ``[T+1]``, terminal 0), then remember
        ``sigmas[1]``, the default ``sigma_max`` of the ``sde`` step."""
        super().set_timesteps(*args, **kwargs)
        self.sigmas = self.sigmas.to(torch.float32)
        self.default_sde_sigma_max = float(self.sigmas[1]) if self.sigmas.numel() > 1 else None

    window_mask = staticmethod(window.window_mask)
    noise_levels = staticmethod(window.noise_levels)
    random_window = staticmethod(window.random_window)

    def sde_step(
        self,
        model_output: torch.Tensor,
        sample: torch.Tensor,
        sigma: float | torch.Tensor,
        sigma_next: float | torch.Tensor,
        *,
        sde_type: SDEType = "sde",
        noise_level: float | torch.Tensor | None = None,
        noise: torch.Tensor | None = None,
        prev_sample: torch.Tensor | None = None,
        sigma_max: float | None = None,
        generator: torch.Generator | list[torch.Generator] | None = None,
    ) -> SDEStepOutput:
        """One step from ``sample`` at ``sigma`` to ``sigma_next`` and its log-prob.

        Args:
            model_output: ``[B, ...]`` velocity prediction, any float dtype (cast to float32).
            sample: ``[B, ...]`` float32 latent at ``sigma``.
            sigma, sigma_next: float or ``[B]``; ``0 <= sigma_next <= sigma <= 1``.
            sde_type: ``"sde"`` (Flow-GRPO), ``"cps"``, ``"dance_sde"`` or ``"ode"``.
            noise_level: float or ``[B]`` (``a`` / ``eta``); required unless ``ode``.
            noise: ``[B, ...]`` float32 standard normal (e.g. ``per_sample_noise``); drawn from
                ``generator`` when None.
            prev_sample: ``[B, ...]`` float32; when given nothing is sampled and the log-prob
                of this latent is returned (how the trainer recomputes log-probs).
            sigma_max: replaces sigma = 1 in the ``sde`` variance's denominator; default
                ``sigmas[1]`` of the schedule.
            generator: torch generator(s) for ``noise`` when it is None.
        """
        if sde_type not in SDE_TYPES:
            raise SchedulerInputError(
                f"unknown sde_type {sde_type!r}; known: {', '.join(SDE_TYPES)}"
            )
        if not isinstance(sample, torch.Tensor):
            raise SchedulerInputError(f"sample must be a tensor, got {type(sample).__name__}")
        x = _require_fp32(sample, "sample", sample.shape)
        if x.ndim < 2:
            raise SchedulerInputError(
                f"sample must be [B, ...] with ndim >= 2, got {tuple(x.shape)}"
            )
        if not isinstance(model_output, torch.Tensor) or model_output.shape != x.shape:
            raise SchedulerInputError(
                f"model_output must be a tensor of shape {tuple(x.shape)}, "
                f"got {tuple(getattr(model_output, 'shape', ()))}"
            )
        if not model_output.dtype.is_floating_point:
            raise SchedulerInputError(
                f"model_output must be floating point, got {model_output.dtype}"
            )
        v = model_output.to(torch.float32)
        batch, device = x.shape[0], x.device
        view = (batch,) + (1,) * (x.ndim - 1)

        s = _per_sample(sigma, batch, device, "sigma")
        s_next = _per_sample(sigma_next, batch, device, "sigma_next")
        if (s > 1).any() or (s_next < 0).any() or (s_next > s).any():
            raise SchedulerInputError("sigmas must satisfy 0 <= sigma_next <= sigma <= 1")

        if sde_type == "ode":
            mean, std_dev_t, step_std = sde_formulas.ode_step(x, v, s.view(view), s_next.view(view))
        else:
            if noise_level is None:
                raise SchedulerInputError(f"noise_level is required for sde_type={sde_type!r}")
            a = _per_sample(noise_level, batch, device, "noise_level")
            if (a < 0).any():
                raise SchedulerInputError("noise_level must be >= 0")
            if (s <= 0).any():
                raise SchedulerInputError(f"{sde_type} step needs sigma > 0")
            a, sv, snv = a.view(view), s.view(view), s_next.view(view)
            if sde_type == "sde":
                smax = self._sde_sigma_max(sigma_max, s)
                mean, std_dev_t, step_std = sde_formulas.flow_sde_step(x, v, sv, snv, a, smax)
            elif sde_type == "cps":
                mean, std_dev_t, step_std = sde_formulas.cps_step(x, v, sv, snv, a)
            else:
                mean, std_dev_t, step_std = sde_formulas.dance_sde_step(x, v, sv, snv, a)
        std_dev_t = std_dev_t.reshape(batch)
        step_std = step_std.reshape(batch)
        stochastic = step_std > 0

        if prev_sample is None:
            if noise is None and bool(stochastic.any()):
                noise = randn_tensor(
                    x.shape, generator=generator, device=device, dtype=torch.float32
                )
            if noise is None:
                prev_sample = mean
            else:
                noise = _require_fp32(noise, "noise", x.shape)
                prev_sample = mean + step_std.view(view) * noise
        else:
            prev_sample = _require_fp32(prev_sample, "prev_sample", x.shape)

        log_prob = self._log_prob(sde_type, prev_sample, mean, step_std.view(view), stochastic)
        return SDEStepOutput(
            prev_sample=prev_sample,
            log_prob=log_prob,
            prev_sample_mean=mean,
            std_dev_t=std_dev_t,
            step_std=step_std,
        )

    def _sde_sigma_max(self, sigma_max: float | None, sigma: torch.Tensor) -> float:
        if sigma_max is None:
            sigma_max = self.default_sde_sigma_max
        if sigma_max is None:
            if bool((sigma == 1).any()):
                raise SchedulerInputError(
                    "sde step at sigma = 1 needs sigma_max: call set_timesteps or pass sigma_max"
                )
            return 0.0  # unused: no sigma equals 1
        sigma_max = float(sigma_max)
        if not 0.0 <= sigma_max < 1.0:
            raise SchedulerInputError(f"sigma_max must be in [0, 1), got {sigma_max}")
        return sigma_max

    @staticmethod
    def _log_prob(
        sde_type: str,
        prev_sample: torch.Tensor,
        mean: torch.Tensor,
        step_std: torch.Tensor,
        stochastic: torch.Tensor,
    ) -> torch.Tensor:
        """``[B]`` log-prob averaged over non-batch dims; 0 where the step is deterministic."""
        batch = prev_sample.shape[0]
        if sde_type == "ode" or not bool(stochastic.any()):
            return torch.zeros(batch, dtype=torch.float32, device=prev_sample.device)
        dims = tuple(range(1, prev_sample.ndim))
        diff2 = (prev_sample.detach() - mean) ** 2
        if sde_type == "cps":
            per_elem = -diff2  # CPS surrogate: no variance scaling, no constants
        else:
            # a safe std where deterministic keeps NaN out of both the value and the gradient
            std = torch.where(step_std > 0, step_std, torch.ones_like(step_std))
            per_elem = -diff2 / (2 * std**2) - torch.log(std) - _LOG_SQRT_2PI
        log_prob = per_elem.mean(dim=dims)
        return torch.where(stochastic, log_prob, torch.zeros_like(log_prob))
