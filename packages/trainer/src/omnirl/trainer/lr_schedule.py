"""Learning-rate schedules over a run's progress.

A run stops at ``max_steps`` or after ``max_minutes``, whichever comes first, so its progress
is the larger of ``step / max_steps`` and ``elapsed / max_minutes`` (an absent limit counts
as 0). The schedule maps progress in [0, 1] to a factor on ``train.lr``:

- ``constant``: 1;
- ``linear``: from 1 down to ``min_ratio`` at the end of the run;
- ``cosine``: ``min_ratio + (1 - min_ratio) * (1 + cos(pi * progress)) / 2``.

An optional linear warm-up (``train.lr_warmup_steps``) multiplies that factor by
``(step + 1) / warmup_steps`` for the first ``warmup_steps`` optimisation steps. It counts
steps, not time: its job is to keep the first updates (advantages from a base that has not
moved, a fresh optimiser's unscaled second moments) small, however fast the machine is.

A time-limited run's schedule follows the wall clock, so two runs of one config on machines
of different speed see different factors at a given step; a step-limited run's does not. The
elapsed time is the run's, not the process's: checkpoints record it and ``--resume`` continues
from it, so a resumed run neither restarts its schedule nor gets a fresh ``max_minutes``.
"""

from __future__ import annotations

import math

SCHEDULES = ("constant", "linear", "cosine")


def check_schedule(name: str, min_ratio: float, warmup_steps: int = 0) -> None:
    """Raise ``ValueError`` naming the bad value."""
    if name not in SCHEDULES:
        raise ValueError(f"lr_schedule must be one of {', '.join(SCHEDULES)}, got {name!r}")
    if not 0.0 <= min_ratio <= 1.0:
        raise ValueError(f"lr_min_ratio must be in [0, 1], got {min_ratio!r}")
    if not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(f"lr_warmup_steps must be an integer >= 0, got {warmup_steps!r}")


def run_progress(
    step: int, max_steps: int | None, elapsed_s: float, max_minutes: float | None
) -> float:
    """How far the run is towards whichever of its limits comes first, in [0, 1]."""
    by_steps = step / max_steps if max_steps else 0.0
    by_time = elapsed_s / (60.0 * max_minutes) if max_minutes else 0.0
    return min(1.0, max(0.0, by_steps, by_time))


def lr_factor(name: str, progress: float, min_ratio: float = 0.0) -> float:
    """The schedule's factor on the base learning rate at ``progress`` in [0, 1]."""
    progress = min(1.0, max(0.0, progress))
    if name == "constant":
        return 1.0
    if name == "linear":
        return 1.0 - (1.0 - min_ratio) * progress
    if name == "cosine":
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"lr_schedule must be one of {', '.join(SCHEDULES)}, got {name!r}")


def warmup_factor(step: int, warmup_steps: int) -> float:
    """The linear warm-up's factor for optimisation step ``step`` (0-based): ``(step + 1) /
    warmup_steps`` while ``step < warmup_steps``, 1 after (and always 1 with no warm-up)."""
    if warmup_steps <= 0 or step >= warmup_steps:
        return 1.0
    return (step + 1) / warmup_steps
