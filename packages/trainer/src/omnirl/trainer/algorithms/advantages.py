"""Per-prompt group advantages (GRPO / Flow-GRPO).

``A_i = clamp((r_i - mean(group)) / (std + eps), -adv_clip_max, adv_clip_max)``

``std`` is the population standard deviation (``ddof = 0``) either of the prompt's own
group (``std="group"``) or of every reward in the batch (``std="global"``, what flow_grpo
does with ``sample.global_std = True``, its default). Both are computed in float64 and
returned as float32. See ``docs/algorithms.md`` ("Advantages").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from omnirl.trainer.algorithms.registry import register_advantage

StdMode = Literal["group", "global"]
STD_MODES: tuple[str, ...] = ("group", "global")


@dataclass(frozen=True, slots=True)
class AdvantageResult:
    """Advantages of a batch of groups.

    Attributes:
        advantages: one float32 tensor ``[G_i]`` per group, in input order.
        zero_groups: indices of the groups whose advantages are all exactly zero
            (singletons, tied rewards); training skips them.
    """

    advantages: list[torch.Tensor]
    zero_groups: list[int]


def _as_rewards(group: torch.Tensor | Sequence[float], index: int) -> torch.Tensor:
    r = torch.as_tensor(group, dtype=torch.float64).reshape(-1)
    if r.numel() == 0:
        raise ValueError(f"group {index} has no rewards")
    if not torch.isfinite(r).all():
        raise ValueError(f"group {index} has non-finite rewards: {r.tolist()}")
    return r


@register_advantage("group")
def group_advantages(
    rewards: Sequence[torch.Tensor | Sequence[float]],
    *,
    std: StdMode = "global",
    adv_clip_max: float | None = 5.0,
    eps: float = 1e-4,
) -> AdvantageResult:
    """Group-relative advantages of ``rewards`` (one 1-D sequence per prompt group).

    A group of one sample, and a group whose rewards are all equal, gets exactly zero
    (the float mean of equal numbers can differ from them by an ulp; we do not let that
    turn into a tiny non-zero advantage). ``adv_clip_max=None`` disables the clamp.
    """
    if std not in STD_MODES:
        raise ValueError(f"std must be one of {STD_MODES}, got {std!r}")
    if adv_clip_max is not None and not adv_clip_max > 0:
        raise ValueError(f"adv_clip_max must be > 0 or None, got {adv_clip_max!r}")
    if not (eps > 0 and math.isfinite(eps)):
        raise ValueError(f"eps must be a positive finite number, got {eps!r}")
    if len(rewards) == 0:
        raise ValueError("no reward groups given")
    groups = [_as_rewards(g, i) for i, g in enumerate(rewards)]
    global_std = torch.cat(groups).std(correction=0) if std == "global" else None

    advantages: list[torch.Tensor] = []
    zero_groups: list[int] = []
    for i, r in enumerate(groups):
        if r.numel() == 1 or bool((r == r[0]).all()):
            adv = torch.zeros_like(r)
        else:
            scale = global_std if global_std is not None else r.std(correction=0)
            adv = (r - r.mean()) / (scale + eps)
            if adv_clip_max is not None:
                adv = adv.clamp(-adv_clip_max, adv_clip_max)
        if not bool(adv.any()):
            zero_groups.append(i)
        advantages.append(adv.to(torch.float32))
    return AdvantageResult(advantages=advantages, zero_groups=zero_groups)
