"""One reverse step x(sigma) -> x(sigma_next) of each SDE variant, as per-sample coefficients.

Every variant is a Gaussian whose mean is linear in the latent and the velocity, and every
log-prob is affine in the mean squared residual:

    mean     = c_x * x + c_v * v
    x'       = mean + step_std * eps
    log_prob = lp_scale * mean((x' - mean)^2) - lp_shift       (averaged over latent elements)

This module computes those coefficients from ``(sigma, sigma_next, a)`` in float64, written
once and evaluated either on Python floats (host values: no device work at all) or on
float64 tensors (values already on a device). IEEE float64 arithmetic gives the same numbers
either way, and they are rounded to float32 where they meet the latent, so rollout and
trainer get bitwise the same step whichever form their sigmas take. The formulas and their
sources are in ``docs/algorithms.md``; the coefficient form is the same algebra as the
references' expressions.
"""

import math
from typing import Any, NamedTuple

import torch

_LOG_SQRT_2PI = math.log(math.sqrt(2 * math.pi))

Num = Any  # a Python float or a float64 tensor; the formulas use only operators and _Ops


class StepCoefficients(NamedTuple):
    c_x: Num
    c_v: Num
    step_std: Num  # the Gaussian's standard deviation (0: deterministic step)
    std_dev_t: Num  # what the reference returns under that name
    lp_scale: Num  # -1 / (2 step_std^2) (cps: -1); 0 where deterministic
    lp_shift: Num  # log(step_std) + log(sqrt(2 pi)) (cps: 0); 0 where deterministic


class _FloatOps:
    sqrt = staticmethod(math.sqrt)
    sin = staticmethod(math.sin)
    log = staticmethod(math.log)

    @staticmethod
    def clamp0(v: float) -> float:
        return max(v, 0.0)

    @staticmethod
    def where_sigma_one(sigma: float, sigma_max: float) -> float:
        return sigma_max if sigma == 1.0 else sigma

    @staticmethod
    def gaussian_lp(std: float) -> tuple[float, float]:
        if std > 0:
            return -1.0 / (2.0 * std * std), math.log(std) + _LOG_SQRT_2PI
        return 0.0, 0.0

    @staticmethod
    def surrogate_lp(std: float) -> tuple[float, float]:
        return (-1.0 if std > 0 else 0.0), 0.0


class _TensorOps:
    sqrt = staticmethod(torch.sqrt)
    sin = staticmethod(torch.sin)
    log = staticmethod(torch.log)

    @staticmethod
    def clamp0(v: torch.Tensor) -> torch.Tensor:
        return torch.clamp(v, min=0)

    @staticmethod
    def where_sigma_one(sigma: torch.Tensor, sigma_max: float) -> torch.Tensor:
        return torch.where(sigma == 1, sigma_max, sigma)

    @staticmethod
    def gaussian_lp(std: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        live = std > 0
        safe = torch.where(live, std, 1.0)  # keeps inf out of the masked-out branch
        scale = torch.where(live, -1.0 / (2.0 * safe * safe), 0.0)
        return scale, torch.where(live, torch.log(safe) + _LOG_SQRT_2PI, 0.0)

    @staticmethod
    def surrogate_lp(std: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.where(std > 0, -1.0, 0.0), torch.zeros_like(std)


def _reverse_sde(sigma: Num, dt: Num, g: Num) -> tuple[Num, Num]:
    """Euler-Maruyama mean of ``dx = [v - g^2/2 * score] dsigma + g dW`` with the linear
    path's score ``-(x + (1 - sigma) v) / sigma``:
    ``mean = x (1 + h dt) + v (1 + h (1 - sigma)) dt``, ``h = g^2 / (2 sigma)``."""
    h = g * g / (2 * sigma)
    return 1 + h * dt, (1 + h * (1 - sigma)) * dt


def _flow_sde(ops, sigma: Num, sigma_next: Num, a: Num, sigma_max: float) -> StepCoefficients:
    """Flow-GRPO: ``g = a * sqrt(sigma / (1 - sigma))``, ``sigma_max`` replacing sigma = 1 in
    the denominator; ``std_dev_t = g`` excludes ``sqrt(-dt)``."""
    dt = sigma_next - sigma
    g = ops.sqrt(sigma / (1 - ops.where_sigma_one(sigma, sigma_max))) * a
    c_x, c_v = _reverse_sde(sigma, dt, g)
    std = g * ops.sqrt(-dt)
    return StepCoefficients(c_x, c_v, std, g, *ops.gaussian_lp(std))


def _dance_sde(ops, sigma: Num, sigma_next: Num, a: Num, sigma_max: float) -> StepCoefficients:
    """DanceGRPO: constant ``g = a`` (eta); its step std ``a * sqrt(sigma - sigma_next)`` is
    also its ``std_dev_t``."""
    dt = sigma_next - sigma
    c_x, c_v = _reverse_sde(sigma, dt, a)
    std = a * ops.sqrt(-dt)
    return StepCoefficients(c_x, c_v, std, std, *ops.gaussian_lp(std))


def _cps(ops, sigma: Num, sigma_next: Num, a: Num, sigma_max: float) -> StepCoefficients:
    """Coefficients-preserving sampling: ``mean = x0 (1 - sigma') + x1 sqrt(sigma'^2 - std^2)``
    with ``x0 = x - sigma v``, ``x1 = x + (1 - sigma) v``, ``std = sigma' sin(a pi / 2)``;
    its log-prob is the surrogate ``-mean((x' - mean)^2)``."""
    std = sigma_next * ops.sin(a * (math.pi / 2))
    # clamp: at a = 1 the difference is a rounding-level negative number
    k = ops.sqrt(ops.clamp0(sigma_next * sigma_next - std * std))
    c_x = (1 - sigma_next) + k
    c_v = (1 - sigma) * k - sigma * (1 - sigma_next)
    return StepCoefficients(c_x, c_v, std, std, *ops.surrogate_lp(std))


_VARIANTS = {"sde": _flow_sde, "cps": _cps, "dance_sde": _dance_sde}


def host_coefficients(
    sde_type: str, sigma: float, sigma_next: float, a: float, sigma_max: float
) -> StepCoefficients:
    """Coefficients of one step from Python floats (float64)."""
    return _VARIANTS[sde_type](_FloatOps, sigma, sigma_next, a, sigma_max)


def tensor_coefficients(
    sde_type: str,
    sigma: torch.Tensor,
    sigma_next: torch.Tensor,
    a: torch.Tensor,
    sigma_max: float,
) -> StepCoefficients:
    """Coefficients of ``[B]`` steps from tensors (computed in float64, on their device)."""
    f64 = torch.float64
    return _VARIANTS[sde_type](_TensorOps, sigma.to(f64), sigma_next.to(f64), a.to(f64), sigma_max)
