"""``FlowMatchSDEScheduler``: diffusers' flow-matching Euler scheduler plus SDE steps with
log-probs, computed in float32 from start to end.

The schedule (``set_timesteps``) is diffusers' own, unchanged. ``sde_step`` takes sigmas
explicitly (``[B]``, so one batch may mix steps, as the trainer's recomputation does) and
keeps no step counter. See ``docs/algorithms.md`` for every formula and its source.
"""

from dataclasses import dataclass
from typing import Literal

import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.utils.torch_utils import randn_tensor

from omnirl.models.schedulers import checks, step_operands, window
from omnirl.models.schedulers.errors import SchedulerInputError

SDEType = Literal["sde", "cps", "dance_sde", "ode"]
SDE_TYPES: tuple[str, ...] = ("sde", "cps", "dance_sde", "ode")


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
        x = checks.require_fp32(sample, "sample")
        if x.ndim < 2:
            raise SchedulerInputError(f"sample must be [B, ...], got shape {tuple(x.shape)}")
        v = checks.require_model_output(model_output, x.shape)
        if prev_sample is not None:
            prev_sample = checks.require_fp32(prev_sample, "prev_sample", x.shape)
        batch, device = x.shape[0], x.device
        view = (batch,) + (1,) * (x.ndim - 1)
        s = step_operands.resolve(sigma, batch, "sigma")
        s_next = step_operands.resolve(sigma_next, batch, "sigma_next")
        checks.check_sigmas(
            s if isinstance(s, list) else None,
            s_next if isinstance(s_next, list) else None,
            positive=sde_type != "ode",
        )

        if sde_type == "ode":
            mean = x + v * step_operands.ode_dt(s, s_next, batch, device, view)
            zeros = torch.zeros(batch, dtype=torch.float32, device=device)
            return SDEStepOutput(
                prev_sample=mean if prev_sample is None else prev_sample,
                log_prob=zeros,
                prev_sample_mean=mean,
                std_dev_t=zeros,
                step_std=zeros,
            )

        if noise_level is None:
            raise SchedulerInputError(f"noise_level is required for sde_type={sde_type!r}")
        a = step_operands.resolve(noise_level, batch, "noise_level")
        checks.check_noise_level(a if isinstance(a, list) else None)
        smax = self._sde_sigma_max(sigma_max, s) if sde_type == "sde" else 0.0
        op = step_operands.stochastic(sde_type, s, s_next, a, smax, batch, device, view)
        mean = x * op.c_x + v * op.c_v

        if prev_sample is None:
            if op.deterministic:
                prev_sample = mean
            else:
                if noise is None:
                    noise = randn_tensor(
                        x.shape, generator=generator, device=device, dtype=torch.float32
                    )
                noise = checks.require_fp32(noise, "noise", x.shape)
                prev_sample = mean + op.step_std * noise

        if op.deterministic:
            log_prob = torch.zeros(batch, dtype=torch.float32, device=device)
        else:
            diff = prev_sample.detach() - mean
            msq = (diff * diff).mean(dim=tuple(range(1, x.ndim)))
            log_prob = msq * op.lp_scale - op.lp_shift
        return SDEStepOutput(
            prev_sample=prev_sample,
            log_prob=log_prob,
            prev_sample_mean=mean,
            std_dev_t=op.std_dev_t_b,
            step_std=op.step_std_b,
        )

    def _sde_sigma_max(self, sigma_max: float | None, sigma: list[float] | torch.Tensor) -> float:
        sigma_max = checks.check_sigma_max(sigma_max)
        if sigma_max is None:
            sigma_max = self.default_sde_sigma_max
        if sigma_max is not None:
            return sigma_max
        if isinstance(sigma, list) and 1.0 not in sigma:
            return 0.0  # never used: no sigma equals 1
        raise SchedulerInputError(
            "an sde step that may start at sigma = 1 needs sigma_max: "
            "call set_timesteps or pass sigma_max"
        )
