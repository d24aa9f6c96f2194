"""Argument checks of ``FlowMatchSDEScheduler.sde_step``.

Values (ranges, finiteness) are checked only where they are on the host (Python floats, CPU
tensors): checking a GPU tensor's values would force a device sync on every step, stalling
the sampling loop. Dtypes and shapes are always checked.
"""

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


def per_sample(
    value: float | torch.Tensor, batch: int, device: torch.device, name: str
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A float or a 0-d / [1] / [B] tensor as float32 ``[B]`` on ``device``, and the same
    values on the host when they were there already (else None).

    A float (or a one-element host tensor) becomes a fill on ``device``, never a host-to-device
    copy, which would wait for the device's queue."""
    if isinstance(value, torch.Tensor):
        if value.ndim > 1 or value.numel() not in (1, batch):
            raise SchedulerInputError(
                f"{name} must be a float or a [B] tensor with B={batch}, "
                f"got shape {tuple(value.shape)}"
            )
        if value.device.type != "cpu":
            return value.detach().to(torch.float32).reshape(-1).expand(batch).contiguous(), None
        host = value.detach().to(torch.float32).reshape(-1)
    else:
        try:
            host = torch.tensor([float(value)], dtype=torch.float32)
        except (TypeError, ValueError) as exc:
            raise SchedulerInputError(f"{name} must be a float or a [B] tensor") from exc
    if not bool(torch.isfinite(host).all()):
        raise SchedulerInputError(f"{name} must be finite, got {host.tolist()}")
    if host.numel() == 1:
        on_device = torch.full((batch,), float(host[0]), dtype=torch.float32, device=device)
    else:
        on_device = host.to(device)
    return on_device, host.expand(batch)


def check_sigmas(
    sigma: torch.Tensor | None, sigma_next: torch.Tensor | None, positive: bool
) -> None:
    """``0 <= sigma_next <= sigma <= 1`` (``sigma > 0`` when ``positive``), on host values."""
    if sigma is not None and (bool((sigma > 1).any()) or bool((sigma < 0).any())):
        raise SchedulerInputError(f"sigma must be in [0, 1], got {sigma.tolist()}")
    if sigma_next is not None and (bool((sigma_next > 1).any()) or bool((sigma_next < 0).any())):
        raise SchedulerInputError(f"sigma_next must be in [0, 1], got {sigma_next.tolist()}")
    if sigma is not None and sigma_next is not None and bool((sigma_next > sigma).any()):
        raise SchedulerInputError("sigmas must satisfy 0 <= sigma_next <= sigma <= 1")
    if positive and sigma is not None and bool((sigma <= 0).any()):
        raise SchedulerInputError("a stochastic step needs sigma > 0")


def check_noise_level(noise_level: torch.Tensor | None) -> None:
    if noise_level is not None and bool((noise_level < 0).any()):
        raise SchedulerInputError(f"noise_level must be >= 0, got {noise_level.tolist()}")


def check_sigma_max(sigma_max: float | None) -> float | None:
    if sigma_max is None:
        return None
    sigma_max = float(sigma_max)
    if not 0.0 <= sigma_max < 1.0:
        raise SchedulerInputError(f"sigma_max must be in [0, 1), got {sigma_max}")
    return sigma_max
