"""From ``sde_step``'s per-sample arguments to the operands that meet the latent.

Sigmas and noise levels arrive as floats, host tensors or device tensors. Host values are
checked in plain Python and, when the whole batch shares them (the rollout's case), turned
into Python-float coefficients: the step then costs only its few latent-sized operations.
Otherwise the coefficients are computed as float64 ``[B]`` tensors on the latent's device.
Both give the same float32 operands (see ``sde_formulas``).
"""

from typing import NamedTuple

import numpy as np
import torch

from omnirl.models.schedulers import checks, sde_formulas
from omnirl.models.schedulers.errors import SchedulerInputError

Operand = float | torch.Tensor  # a Python float, or float32 [B, 1, ..., 1]


class StepOperands(NamedTuple):
    c_x: Operand
    c_v: Operand
    step_std: Operand
    lp_scale: Operand  # float, or float32 [B]
    lp_shift: Operand  # float, or float32 [B]
    std_dev_t_b: torch.Tensor  # float32 [B]
    step_std_b: torch.Tensor  # float32 [B]
    deterministic: bool  # every step_std is known to be 0


def resolve(value: float | torch.Tensor, batch: int, name: str) -> list[float] | torch.Tensor:
    """Host values as a list (length 1 or B), checked finite; a device tensor as float32 [B]."""
    if isinstance(value, torch.Tensor):
        if value.ndim > 1 or value.numel() not in (1, batch):
            raise SchedulerInputError(
                f"{name} must be a float or a [B] tensor with B={batch}, "
                f"got shape {tuple(value.shape)}"
            )
        if value.device.type != "cpu":
            return value.detach().to(torch.float32).reshape(-1).expand(batch)
        host = value.detach().to(torch.float32).reshape(-1).tolist()
    else:
        try:
            # rounded to float32 first, so a float and a float32 tensor are the same input
            host = [float(np.float32(value))]
        except (TypeError, ValueError) as exc:
            raise SchedulerInputError(f"{name} must be a float or a [B] tensor") from exc
    checks.check_finite(host, name)
    return host


def _uniform(values: list[float]) -> bool:
    return all(v == values[0] for v in values)


def _on_device(values: list[float] | torch.Tensor, batch: int, device: torch.device, dtype):
    """``[B]`` tensor of ``dtype`` on ``device``; a single host value becomes a fill (no copy)."""
    if isinstance(values, torch.Tensor):
        return values.to(device=device, dtype=dtype)
    if len(values) == 1 or _uniform(values):
        return torch.full((batch,), values[0], dtype=dtype, device=device)
    cpu = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        cpu = cpu.pin_memory()  # asynchronous copy: no wait for the device's queue
    return cpu.to(device, non_blocking=True)


def ode_dt(
    sigma: list[float] | torch.Tensor,
    sigma_next: list[float] | torch.Tensor,
    batch: int,
    device: torch.device,
    view: tuple[int, ...],
) -> Operand:
    """``sigma_next - sigma`` rounded to float32 (exactly the float32 subtraction's result)."""
    host = isinstance(sigma, list) and isinstance(sigma_next, list)
    if host and _uniform(sigma) and _uniform(sigma_next):
        return sigma_next[0] - sigma[0]
    s = _on_device(sigma, batch, device, torch.float32)
    return (_on_device(sigma_next, batch, device, torch.float32) - s).view(view)


def stochastic(
    sde_type: str,
    sigma: list[float] | torch.Tensor,
    sigma_next: list[float] | torch.Tensor,
    a: list[float] | torch.Tensor,
    sigma_max: float,
    batch: int,
    device: torch.device,
    view: tuple[int, ...],
) -> StepOperands:
    """The operands of an ``sde`` / ``cps`` / ``dance_sde`` step."""
    args = (sigma, sigma_next, a)
    if all(isinstance(t, list) for t in args) and all(_uniform(t) for t in args):
        c = sde_formulas.host_coefficients(sde_type, sigma[0], sigma_next[0], a[0], sigma_max)
        return StepOperands(
            c_x=c.c_x,
            c_v=c.c_v,
            step_std=c.step_std,
            lp_scale=c.lp_scale,
            lp_shift=c.lp_shift,
            std_dev_t_b=torch.full((batch,), c.std_dev_t, dtype=torch.float32, device=device),
            step_std_b=torch.full((batch,), c.step_std, dtype=torch.float32, device=device),
            deterministic=c.step_std == 0,
        )
    f64 = torch.float64
    c = sde_formulas.tensor_coefficients(
        sde_type, *(_on_device(t, batch, device, f64) for t in args), sigma_max
    )
    step_std = c.step_std.to(torch.float32)
    return StepOperands(
        c_x=c.c_x.to(torch.float32).view(view),
        c_v=c.c_v.to(torch.float32).view(view),
        step_std=step_std.view(view),
        lp_scale=c.lp_scale.to(torch.float32),
        lp_shift=c.lp_shift.to(torch.float32),
        std_dev_t_b=c.std_dev_t.to(torch.float32),
        step_std_b=step_std,
        deterministic=isinstance(a, list) and not any(level > 0 for level in a),
    )
