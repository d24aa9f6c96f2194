"""Exponential moving average of the trainable parameters.

``ema <- ema + (1 - d_n) * (param - ema)`` after optimisation step ``n`` (0-based), with
``d_n = min(decay, (1 + n) / (10 + n))`` when ``warmup`` is on (flow_grpo's schedule:
early steps move the average fast) and ``d_n = decay`` otherwise. The average is kept in
float32 on the parameters' device, whatever the parameters' dtype.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch


class EMA:
    """EMA of a fixed list of parameters (the optimiser's, in the same order)."""

    def __init__(
        self, parameters: Iterable[torch.nn.Parameter], *, decay: float, warmup: bool = True
    ) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"ema decay must be in [0, 1), got {decay!r}")
        self.parameters = list(parameters)
        if not self.parameters:
            raise ValueError("EMA needs at least one parameter")
        self.decay = decay
        self.warmup = warmup
        self.num_updates = 0
        self.shadow = [p.detach().to(torch.float32).clone() for p in self.parameters]

    def current_decay(self) -> float:
        n = self.num_updates
        return min(self.decay, (1 + n) / (10 + n)) if self.warmup else self.decay

    @torch.no_grad()
    def update(self) -> None:
        """Move the average towards the parameters' current values (call after a step)."""
        one_minus = 1.0 - self.current_decay()
        for s, p in zip(self.shadow, self.parameters, strict=True):
            s.add_(p.detach().to(torch.float32) - s, alpha=one_minus)
        self.num_updates += 1

    @torch.no_grad()
    def copy_to(self, parameters: Iterable[torch.nn.Parameter] | None = None) -> None:
        """Write the average into ``parameters`` (default: the tracked ones)."""
        targets = self.parameters if parameters is None else list(parameters)
        for s, p in zip(self.shadow, targets, strict=True):
            p.copy_(s.to(p.dtype))

    @contextmanager
    def swapped_in(self) -> Iterator[None]:
        """Inside the block the tracked parameters hold the average; restored on exit."""
        saved = [p.detach().clone() for p in self.parameters]
        try:
            self.copy_to()
            yield
        finally:
            with torch.no_grad():
                for p, v in zip(self.parameters, saved, strict=True):
                    p.copy_(v)

    def state_dict(self) -> dict[str, Any]:
        return {
            "decay": self.decay,
            "warmup": self.warmup,
            "num_updates": self.num_updates,
            "shadow": [s.clone() for s in self.shadow],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        shadow = state["shadow"]
        if len(shadow) != len(self.shadow):
            raise ValueError(
                f"EMA state holds {len(shadow)} tensors, this EMA tracks {len(self.shadow)}"
            )
        for mine, theirs in zip(self.shadow, shadow, strict=True):
            if mine.shape != theirs.shape:
                raise ValueError(f"EMA state shape {tuple(theirs.shape)} != {tuple(mine.shape)}")
        with torch.no_grad():
            for mine, theirs in zip(self.shadow, shadow, strict=True):
                mine.copy_(theirs)
        self.decay = float(state["decay"])
        self.warmup = bool(state["warmup"])
        self.num_updates = int(state["num_updates"])
