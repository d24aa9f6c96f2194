"""The optimiser over the trainable parameters only."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimConfig:
    """AdamW hyper-parameters (flow_grpo's defaults but the learning rate)."""

    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 1e-4
    eps: float = 1e-8

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr!r}")
        if not all(0.0 <= b < 1.0 for b in self.betas) or len(self.betas) != 2:
            raise ValueError(f"betas must be two numbers in [0, 1), got {self.betas!r}")
        if not self.weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay!r}")


def trainable(parameters: Iterable[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """``parameters`` that require grad, each once, in first-seen order."""
    seen: set[int] = set()
    out: list[torch.nn.Parameter] = []
    for p in parameters:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    if not out:
        raise ValueError("no trainable parameters (none requires grad)")
    return out


def build_adamw(params: list[torch.nn.Parameter], config: OptimConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        params,
        lr=config.lr,
        betas=tuple(config.betas),
        weight_decay=config.weight_decay,
        eps=config.eps,
    )


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set every parameter group's learning rate (a schedule's value for this step)."""
    if not lr >= 0:
        raise ValueError(f"learning rate must be >= 0, got {lr!r}")
    for group in optimizer.param_groups:
        group["lr"] = lr
