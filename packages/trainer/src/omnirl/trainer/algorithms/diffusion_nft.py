"""DiffusionNFT: the forward-process objective with positive / negative velocity mixing.

Zheng et al. 2025, *DiffusionNFT: Online Diffusion Reinforcement with Forward Process*
(arXiv:2509.16117); code NVlabs/DiffusionNFT ``scripts/train_nft_sd3.py``. No log-probs: the
trainer re-noises each rollout's clean sample ``x0`` on the flow path and, per row,

```
x_t  = (1 - t) x0 + t eps                                   t from the sampling schedule
v+   = beta * v_theta + (1 - beta) * v_old                  (implicit positive policy)
v-   = (1 + beta) * v_old - beta * v_theta                  (implicit negative policy)
x0±  = x_t - t * v±
L±   = mean((x0± - x0)^2) / max(mean|x0± - x0|, 1e-5)       (weight detached, "adaptive")
r    = clamp(clamp(A, -c, c) / c / 2 + 1/2, 0, 1)           optimality probability, c = adv_clip_max
loss = mean_rows(c * (r * L+ + (1 - r) * L-) / beta) + kl_beta * mean((v_theta - v_ref)^2)
```

``v_old`` is a lagging copy of the trainable parameters (see ``forward_step.py``), updated
after each ``step()`` call as ``old <- d * old + (1 - d) * theta`` with
``d = min(old_decay_rate * n, old_decay_max)`` after ``n`` optimiser updates (NVlabs
``return_decay``, ``decay_type = 1``: 0.001, 0.5).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from omnirl.trainer.algorithms.flow_grpo import LossOutput
from omnirl.trainer.algorithms.registry import AlgorithmSpec, register_algorithm, register_loss

WEIGHT_FLOOR = 1e-5  # NVlabs clips the adaptive weight at this value


def optimality_probability(advantages: Tensor, adv_clip_max: float) -> Tensor:
    """``r = clamp(A, -c, c) / (2 c) + 1/2`` in ``[0, 1]``: 1 for the best, 0 for the worst."""
    a = advantages.clamp(-adv_clip_max, adv_clip_max)
    return (a / adv_clip_max / 2.0 + 0.5).clamp(0.0, 1.0)


def old_policy_decay(num_updates: int, *, rate: float, max_decay: float) -> float:
    """The lagging copy's decay after ``num_updates`` optimiser updates: ``min(rate * n, max)``."""
    return min(rate * num_updates, max_decay)


def _per_row_mean(x: Tensor) -> Tensor:
    return x.mean(dim=tuple(range(1, x.dim())))


def adaptive_x0_loss(x0_pred: Tensor, x0: Tensor) -> Tensor:
    """``mean((x0_pred - x0)^2) / max(mean|x0_pred - x0|, 1e-5)`` per row ``[B]``.

    The normaliser is computed in float64 and carries no gradient, as NVlabs does.
    """
    err = x0_pred - x0
    with torch.no_grad():
        weight = _per_row_mean(err.double().abs()).clamp(min=WEIGHT_FLOOR).to(err.dtype)
    return _per_row_mean(err.pow(2)) / weight


@dataclass(frozen=True, kw_only=True, slots=True)
class NFTLossInputs:
    """One micro-batch of re-noised clean samples; ``B`` rows, all float32.

    Only ``v_theta`` carries a gradient.
    """

    x0: Tensor  # [B, C, H, W] clean sample (the rollout's final latents)
    x_t: Tensor  # [B, C, H, W] (1 - t) x0 + t eps
    t: Tensor  # [B] noise level in [0, 1]
    v_theta: Tensor  # [B, C, H, W] trained policy's velocity
    v_old: Tensor  # [B, C, H, W] lagging copy's velocity (detached)
    advantages: Tensor  # [B] group advantages (clamped or not: clamped again here)
    v_ref: Tensor | None = None  # [B, C, H, W] reference velocity; needed iff kl_beta > 0


@register_loss("diffusion_nft")
class DiffusionNFTLoss:
    """The NFT policy loss of the module docstring, plus the optional velocity KL."""

    @dataclass(frozen=True, kw_only=True, slots=True)
    class Config:
        nft_beta: float = 1.0
        adv_clip_max: float = 5.0
        kl_beta: float = 0.0

        def __post_init__(self) -> None:
            if not self.nft_beta > 0:
                raise ValueError(f"nft_beta must be > 0, got {self.nft_beta!r}")
            if not 0 < self.adv_clip_max < float("inf"):
                raise ValueError(
                    f"adv_clip_max must be finite and > 0 for DiffusionNFT (it maps advantages "
                    f"to [0, 1]), got {self.adv_clip_max!r}"
                )
            if not self.kl_beta >= 0:
                raise ValueError(f"kl_beta must be >= 0, got {self.kl_beta!r}")

    def __init__(self, config: DiffusionNFTLoss.Config | None = None) -> None:
        self.config = config or DiffusionNFTLoss.Config()

    def needs_reference(self) -> bool:
        return self.config.kl_beta > 0

    def needs_old(self) -> bool:
        return True

    def __call__(self, inputs: NFTLossInputs) -> LossOutput:
        cfg = self.config
        x0, x_t, v_theta = inputs.x0, inputs.x_t, inputs.v_theta
        v_old = inputs.v_old.detach()
        if not (x0.shape == x_t.shape == v_theta.shape == v_old.shape):
            raise ValueError(
                "x0, x_t, v_theta and v_old must share one shape; got "
                f"{[tuple(t.shape) for t in (x0, x_t, v_theta, v_old)]}"
            )
        rows = x0.shape[0]
        if inputs.t.shape != (rows,) or inputs.advantages.shape != (rows,):
            raise ValueError(
                f"t and advantages must be [{rows}]; got {tuple(inputs.t.shape)} and "
                f"{tuple(inputs.advantages.shape)}"
            )
        beta = cfg.nft_beta
        t = inputs.t.view(-1, *([1] * (x0.dim() - 1)))
        v_pos = beta * v_theta + (1.0 - beta) * v_old
        v_neg = (1.0 + beta) * v_old - beta * v_theta
        loss_pos = adaptive_x0_loss(x_t - t * v_pos, x0)  # [B]
        loss_neg = adaptive_x0_loss(x_t - t * v_neg, x0)  # [B]
        r = optimality_probability(inputs.advantages, cfg.adv_clip_max)
        per_row = cfg.adv_clip_max * (r * loss_pos + (1.0 - r) * loss_neg) / beta
        policy_loss = per_row.mean()
        if cfg.kl_beta > 0:
            if inputs.v_ref is None:
                raise ValueError("kl_beta > 0 needs v_ref")
            kl = _per_row_mean((v_theta - inputs.v_ref.detach()).pow(2)).mean()
            loss = policy_loss + cfg.kl_beta * kl
        else:
            kl = torch.zeros((), dtype=policy_loss.dtype, device=policy_loss.device)
            loss = policy_loss
        per_sample = {
            "optimality": r.detach(),
            "old_deviation": _per_row_mean((v_theta.detach() - v_old).pow(2)),
        }
        return LossOutput(
            loss=loss, policy_loss=policy_loss.detach(), kl=kl.detach(), per_sample=per_sample
        )


register_algorithm(
    AlgorithmSpec(
        name="diffusion_nft",
        sde_type="ode",
        advantage="group",
        loss="diffusion_nft",
        adapter_algorithm="flow_grpo",
        needs_log_probs=False,
        defaults={
            "adv_clip_max": 5.0,
            "std": "global",
            "kl_beta": 1e-4,
            "timestep_fraction": 0.99,
            "nft_beta": 1.0,
            "old_decay_rate": 0.001,
            "old_decay_max": 0.5,
        },
        sampling_defaults={"sde_type": "ode", "noise_level": 0.0},
        description="DiffusionNFT (Zheng et al. 2025), NVlabs/DiffusionNFT scripts/train_nft_sd3.py",
    )
)
