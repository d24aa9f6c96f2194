"""One reverse step x(sigma) -> x(sigma_next) of each SDE variant, as a Gaussian.

Pure float32 tensor functions; the formulas and their sources are in ``docs/algorithms.md``.
Shapes: ``x``, ``v`` are ``[B, ...]``; ``sigma``, ``sigma_next``, ``a`` (noise level) are
already viewed as ``[B, 1, ..., 1]`` so they broadcast. Each function returns
``(mean, std_dev_t, step_std)``, all broadcastable to ``x``: ``mean`` is the Gaussian's mean,
``step_std`` its standard deviation, ``std_dev_t`` the quantity the reference returns under
that name (for ``sde`` it excludes ``sqrt(-dt)``; for ``cps`` and ``dance_sde`` it equals
``step_std``).
"""

import math

import torch

Step = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def ode_step(
    x: torch.Tensor, v: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor
) -> Step:
    """Euler step of the probability-flow ODE: ``x + (sigma_next - sigma) * v``."""
    dt = sigma_next - sigma
    zero = torch.zeros_like(sigma)
    return x + dt * v, zero, zero


def flow_sde_step(
    x: torch.Tensor,
    v: torch.Tensor,
    sigma: torch.Tensor,
    sigma_next: torch.Tensor,
    a: torch.Tensor,
    sigma_max: float,
) -> Step:
    """Flow-GRPO: Euler-Maruyama step of the marginal-preserving SDE with
    ``g(sigma) = a * sqrt(sigma / (1 - sigma))``; ``sigma_max`` replaces sigma = 1 in the
    denominator."""
    dt = sigma_next - sigma
    denom = 1 - torch.where(sigma == 1, torch.full_like(sigma, sigma_max), sigma)
    std_dev_t = torch.sqrt(sigma / denom) * a
    var = std_dev_t**2
    mean = x * (1 + var / (2 * sigma) * dt) + v * (1 + var * (1 - sigma) / (2 * sigma)) * dt
    return mean, std_dev_t, std_dev_t * torch.sqrt(-dt)


def cps_step(
    x: torch.Tensor, v: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor, a: torch.Tensor
) -> Step:
    """Coefficients-preserving sampling: re-noise the predicted x0 to ``sigma_next`` with the
    predicted noise (coefficient ``sqrt(sigma_next^2 - std^2)``) plus fresh noise of std
    ``sigma_next * sin(a * pi / 2)``."""
    std = sigma_next * torch.sin(a * (math.pi / 2))
    x0 = x - sigma * v
    x1 = x + (1 - sigma) * v
    # clamp: sin(a pi/2) = 1 makes the difference a rounding-level negative number
    mean = x0 * (1 - sigma_next) + x1 * torch.sqrt(torch.clamp(sigma_next**2 - std**2, min=0))
    return mean, std, std


def dance_sde_step(
    x: torch.Tensor, v: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor, a: torch.Tensor
) -> Step:
    """DanceGRPO: Euler-Maruyama step of the reverse SDE with constant ``g = a`` (eta); the
    score of the linear path is ``-(x - (1 - sigma) x0) / sigma^2``."""
    dt = sigma_next - sigma
    x0 = x - sigma * v
    score = -(x - (1 - sigma) * x0) / sigma**2
    mean = x + dt * v - 0.5 * a**2 * score * dt
    std = a * torch.sqrt(-dt)
    return mean, std, std
