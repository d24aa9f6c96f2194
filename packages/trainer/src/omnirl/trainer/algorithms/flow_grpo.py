"""The FlowGRPO loss, generalised to the decoupled PPO objective; FlowGRPO's algorithms.

Per (sample, trained step), with ``A`` the group advantage and three log-probs of the
recorded transition ``x_k -> x_{k+1}``:

- ``behav``: recorded by the rollout worker under the policy version that sampled it,
- ``prox``: the proximal policy, i.e. the trainer's policy at the start of this update,
- ``new``: the policy being optimised (carries the gradient),

``ratio = exp(new - prox)``, ``w = min(exp(prox - behav), w_max)`` (no gradient) and

``policy_loss = mean(w * max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps)))``

``loss = policy_loss + kl_beta * mean(kl)`` with :func:`~omnirl.trainer.algorithms.kl.flow_grpo_kl`.

With ``prox == behav`` (on-policy, or ``prox`` taken to be ``behav``) ``w`` is exactly 1
and this is flow_grpo's loss term for term. The decoupled form is AReaL's (Fu et al.
2025, "AReaL: A Large-Scale Asynchronous Reinforcement Learning System for Language
Reasoning"): the clip is taken against the proximal policy, the staleness is corrected by
the behaviour importance weight. AReaL drops samples whose weight exceeds the cap; we
truncate the weight at ``w_max`` instead (see ``docs/algorithms.md``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from omnirl.trainer.algorithms.kl import flow_grpo_kl
from omnirl.trainer.algorithms.registry import (
    AlgorithmSpec,
    register_algorithm,
    register_alias,
    register_loss,
)

# Names of the inputs a loss may ask for (fields of LossInputs).
LOG_PROB = "log_prob"
PROX_LOG_PROB = "prox_log_prob"
BEHAV_LOG_PROB = "behav_log_prob"
ADVANTAGES = "advantages"
PREV_SAMPLE_MEAN = "prev_sample_mean"
REF_PREV_SAMPLE_MEAN = "ref_prev_sample_mean"
STD_DEV_T = "std_dev_t"
PROX_PREV_SAMPLE_MEAN = "prox_prev_sample_mean"
STEP_STD = "step_std"
SQRT_DT = "sqrt_dt"


@dataclass(frozen=True, kw_only=True, slots=True)
class LossInputs:
    """One micro-batch of transitions at one step index; ``B`` = samples.

    All float32. Only ``log_prob`` and ``prev_sample_mean`` carry gradients.
    """

    log_prob: torch.Tensor  # [B] new policy
    prox_log_prob: torch.Tensor  # [B] proximal policy (detached)
    behav_log_prob: torch.Tensor  # [B] behaviour policy (recorded by rollout)
    advantages: torch.Tensor  # [B]
    prev_sample_mean: torch.Tensor | None = None  # [B, ...] new policy's step mean
    ref_prev_sample_mean: torch.Tensor | None = None  # [B, ...] reference's step mean
    std_dev_t: torch.Tensor | None = None  # [B]
    prox_prev_sample_mean: torch.Tensor | None = None  # [B, ...] proximal step mean (detached)
    step_std: torch.Tensor | None = None  # [B] the step's total std (0: deterministic)
    sqrt_dt: torch.Tensor | None = None  # [B] sqrt(sigma - sigma_next)


@dataclass(frozen=True, kw_only=True, slots=True)
class LossOutput:
    """``loss`` is what to back-propagate; the rest is detached, for metrics.

    ``per_sample`` holds ``[B]`` vectors (``ratio``, ``clipped``, ``importance_weight``,
    ``log_ratio``) so that statistics can be taken over a whole update, not averaged means.
    """

    loss: torch.Tensor
    policy_loss: torch.Tensor
    kl: torch.Tensor
    per_sample: dict[str, torch.Tensor] = field(default_factory=dict)


@register_loss("flow_grpo")
class FlowGRPOLoss:
    """PPO-clip with tiny clip ranges, decoupled behaviour / proximal, optional KL."""

    @dataclass(frozen=True, kw_only=True, slots=True)
    class Config:
        clip_range: float = 1e-4
        kl_beta: float = 0.0
        w_max: float = 2.0  # truncation of the behaviour importance weight

        def __post_init__(self) -> None:
            if not self.clip_range > 0:
                raise ValueError(f"clip_range must be > 0, got {self.clip_range!r}")
            if not self.kl_beta >= 0:
                raise ValueError(f"kl_beta must be >= 0, got {self.kl_beta!r}")
            if not self.w_max >= 1:
                raise ValueError(f"w_max must be >= 1, got {self.w_max!r}")

    def __init__(self, config: FlowGRPOLoss.Config | None = None) -> None:
        self.config = config or FlowGRPOLoss.Config()

    def needs(self) -> frozenset[str]:
        """The :class:`LossInputs` fields this configuration reads."""
        base = {LOG_PROB, PROX_LOG_PROB, BEHAV_LOG_PROB, ADVANTAGES}
        if self.config.kl_beta > 0:
            base |= {PREV_SAMPLE_MEAN, REF_PREV_SAMPLE_MEAN, STD_DEV_T}
        return frozenset(base)

    def __call__(self, inputs: LossInputs) -> LossOutput:
        cfg = self.config
        new, adv = inputs.log_prob, inputs.advantages
        prox, behav = inputs.prox_log_prob.detach(), inputs.behav_log_prob.detach()
        if not (new.shape == prox.shape == behav.shape == adv.shape and new.dim() == 1):
            raise ValueError(
                "log_prob, prox_log_prob, behav_log_prob and advantages must all be [B]; got "
                f"{[tuple(t.shape) for t in (new, prox, behav, adv)]}"
            )
        log_ratio = new - prox
        ratio = torch.exp(log_ratio)
        clipped_ratio = ratio.clamp(1.0 - cfg.clip_range, 1.0 + cfg.clip_range)
        per_sample_pg = torch.maximum(-adv * ratio, -adv * clipped_ratio)
        weight = torch.exp(prox - behav).clamp(max=cfg.w_max)
        policy_loss = (weight * per_sample_pg).mean()

        if cfg.kl_beta > 0:
            if (
                inputs.prev_sample_mean is None
                or inputs.ref_prev_sample_mean is None
                or inputs.std_dev_t is None
            ):
                raise ValueError(
                    "kl_beta > 0 needs prev_sample_mean, ref_prev_sample_mean and std_dev_t"
                )
            kl = flow_grpo_kl(
                inputs.prev_sample_mean, inputs.ref_prev_sample_mean.detach(), inputs.std_dev_t
            ).mean()
            loss = policy_loss + cfg.kl_beta * kl
        else:
            kl = torch.zeros((), dtype=policy_loss.dtype, device=policy_loss.device)
            loss = policy_loss

        per_sample = {
            "ratio": ratio.detach(),
            "log_ratio": log_ratio.detach(),
            "clipped": ((ratio.detach() - 1.0).abs() > cfg.clip_range).to(torch.float32),
            "importance_weight": weight,
        }
        return LossOutput(
            loss=loss, policy_loss=policy_loss.detach(), kl=kl.detach(), per_sample=per_sample
        )


# ------------------------------------------------------------------------------ algorithms

register_algorithm(
    AlgorithmSpec(
        name="flow_grpo",
        sde_type="sde",
        advantage="group",
        loss="flow_grpo",
        adapter_algorithm="flow_grpo",
        defaults={"clip_range": 1e-4, "adv_clip_max": 5.0, "std": "global", "kl_beta": 0.0},
        sampling_defaults={"sde_type": "sde", "noise_level": 0.7},
        description="Flow-GRPO (Liu et al. 2025), flow_grpo scripts/train_sd3.py",
    )
)

# flow_grpo's CPS configs (sample.sde_type = "cps") keep the estimator and the loss and set
# clip_range = 1e-5 with noise_level = 0.8: CPS "log-probs" are unscaled squared distances.
register_alias(
    "flow_grpo_cps",
    of="flow_grpo",
    sde_type="cps",
    defaults={"clip_range": 1e-5},
    sampling_defaults={"sde_type": "cps", "noise_level": 0.8},
    description="Flow-GRPO with coefficients-preserving sampling (flow_grpo sde_type='cps')",
)

# DanceGRPO is registered in omnirl.trainer.algorithms.dance_grpo.
