"""Argument checks of ``FlowMatchSDEScheduler.sde_step``.

Values (ranges, finiteness) are checked only where they are on the host (Python floats, CPU
tensors), in plain Python: checking a GPU tensor's values would force a device sync on every
step, stalling the sampling loop. Dtypes and shapes are always checked.
"""

import math

import torch

from omnirl.models.schedulers.errors import SchedulerInputError


def require_fp32(t: object, name: str, shape: torch.Size | None = None) -> torch.Tensor:
    """``t`` itself, if it is a float32 tensor (of ``shape``, when given)."""
    if not isinstance(t, torch.Tensor):
        raise SchedulerInputError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dtype != torch.float32:
        raise SchedulerInputError(
            f"{name} must be float32 (got {t.dtype}); keep latents in float32 end to end, "
            "a lower precision copy changes the log-prob"
        )
    if shape is not None and t.shape != shape:
        raise SchedulerInputError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    return t


def require_model_output(model_output: object, shape: torch.Size) -> torch.Tensor:
    """``model_output`` cast to float32, if it is a floating tensor of ``shape``."""
    if not isinstance(model_output, torch.Tensor) or model_output.shape != shape:
        got = tuple(getattr(model_output, "shape", ()))
        raise SchedulerInputError(
            f"model_output must be a tensor of shape {tuple(shape)}, got {got}"
        )
    if not model_output.dtype.is_floating_point:
        raise SchedulerInputError(f"model_output must be floating point, got {model_output.dtype}")
    return model_output.to(torch.float32)


def check_finite(values: list[float], name: str) -> None:
    if not all(math.isfinite(v) for v in values):
        raise SchedulerInputError(f"{name} must be finite, got {values}")


def check_sigmas(sigma: list[float] | None, sigma_next: list[float] | None, positive: bool) -> None:
    """``0 <= sigma_next <= sigma <= 1`` (``sigma > 0`` when ``positive``), on host values."""
    if sigma is not None and not all(0.0 <= s <= 1.0 for s in sigma):
        raise SchedulerInputError(f"sigma must be in [0, 1], got {sigma}")
    if sigma_next is not None and not all(0.0 <= s <= 1.0 for s in sigma_next):
        raise SchedulerInputError(f"sigma_next must be in [0, 1], got {sigma_next}")
    if sigma is not None and sigma_next is not None:
        n = max(len(sigma), len(sigma_next))
        s_all = sigma * n if len(sigma) == 1 else sigma
        sn_all = sigma_next * n if len(sigma_next) == 1 else sigma_next
        if any(sn > s for s, sn in zip(s_all, sn_all, strict=True)):
            raise SchedulerInputError("sigmas must satisfy 0 <= sigma_next <= sigma <= 1")
    if positive and sigma is not None and not all(s > 0 for s in sigma):
        raise SchedulerInputError("a stochastic step needs sigma > 0")


def check_noise_level(noise_level: list[float] | None) -> None:
    if noise_level is not None and not all(a >= 0 for a in noise_level):
        raise SchedulerInputError(f"noise_level must be >= 0, got {noise_level}")


def check_sigma_max(sigma_max: float | None) -> float | None:
    if sigma_max is None:
        return None
    sigma_max = float(sigma_max)
    if not 0.0 <= sigma_max < 1.0:
        raise SchedulerInputError(f"sigma_max must be in [0, 1), got {sigma_max}")
    return sigma_max
