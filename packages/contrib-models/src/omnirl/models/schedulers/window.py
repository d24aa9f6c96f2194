"""The SDE window: which steps of a schedule are stochastic and trained.

A window is ``(start, end)``, half-open step indices ``[start, end)`` into the ``T`` steps of
the sampling schedule (the convention of ``SamplingParams.sde_window``); ``None`` means all
steps. Inside the window a step uses the chosen SDE and its noise level; outside it the noise
level is 0, the step is a deterministic ODE step, and it is not trained.
"""

import torch

from omnirl.models.schedulers.errors import SchedulerInputError


def check_window(num_steps: int, window: tuple[int, int] | None) -> tuple[int, int]:
    """Validate ``window`` against ``num_steps``; return it as ``(start, end)``."""
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
        raise SchedulerInputError(f"num_steps must be a positive int, got {num_steps!r}")
    if window is None:
        return 0, num_steps
    try:
        start, end = (int(v) for v in window)
    except (TypeError, ValueError) as exc:
        raise SchedulerInputError(f"window must be (start, end), got {window!r}") from exc
    if not 0 <= start < end <= num_steps:
        raise SchedulerInputError(
            f"window {window!r} must satisfy 0 <= start < end <= num_steps ({num_steps})"
        )
    return start, end


def window_mask(num_steps: int, window: tuple[int, int] | None) -> torch.Tensor:
    """Bool ``[T]``: True where step ``i`` is stochastic and trained."""
    start, end = check_window(num_steps, window)
    mask = torch.zeros(num_steps, dtype=torch.bool)
    mask[start:end] = True
    return mask


def noise_levels(
    num_steps: int, noise_level: float, window: tuple[int, int] | None
) -> torch.Tensor:
    """Float32 ``[T]``: ``noise_level`` inside the window, 0 outside."""
    level = float(noise_level)
    if not level >= 0.0 or level == float("inf"):
        raise SchedulerInputError(f"noise_level must be finite and >= 0, got {noise_level!r}")
    return window_mask(num_steps, window).to(torch.float32) * level


def random_window(
    seed: int, num_steps: int, size: int, window_range: tuple[int, int] | None = None
) -> tuple[int, int]:
    """A window of ``size`` steps starting uniformly inside ``window_range``, drawn from ``seed``.

    The same seed always gives the same window. Use one seed per prompt group: every sample
    of a group must share its window (per-sample windows inflate reward variance).
    """
    lo, hi = check_window(num_steps, window_range)
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= hi - lo:
        raise SchedulerInputError(f"window size must be in [1, {hi - lo}], got {size!r}")
    gen = torch.Generator().manual_seed(int(seed) & ((1 << 63) - 1))
    start = lo + int(torch.randint(0, hi - lo - size + 1, (1,), generator=gen))
    return start, start + size
