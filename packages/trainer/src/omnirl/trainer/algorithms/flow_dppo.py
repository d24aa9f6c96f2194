"""Flow-DPPO: PPO's ratio clip replaced by an exact-divergence trust-region mask.

A single-sample ratio is a noisy estimate of how far the policy moved; the per-step policy
of a flow model is Gaussian, so the divergence itself is exact and cheap. Per (sample,
step), with ``s`` the step's standard deviation (``std_dev_t * sqrt(-dt)`` for ``sde``):

``kl    = mean_latent((mu_new - mu_prox)^2) / (2 * s^2)``  (``add_kl_coefficient=False``: ``/ 2``)
``ratio = exp(logp_new - logp_prox)``
``masked = kl >= kl_mask_threshold and ((ratio > 1 and A > 0) or (ratio < 1 and A < 0))``
``policy_loss = mean(w * (masked ? 0 : -A * ratio))``

A sample is dropped only when it is outside the trust region *and* its update would push
it further out; there is no clip. Advantages are **not** clamped (``adv_clip_max = inf``).
``w`` is the truncated behaviour weight of the decoupled objective. This is the form of
verl-omni's ``flow_dppo`` loss and Flow-Factory's ``dppo`` (defaults: threshold 1e-5,
``add_kl_coefficient=True``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omnirl.trainer.algorithms.flow_grpo import (
    ADVANTAGES,
    BEHAV_LOG_PROB,
    LOG_PROB,
    PREV_SAMPLE_MEAN,
    PROX_LOG_PROB,
    PROX_PREV_SAMPLE_MEAN,
    REF_PREV_SAMPLE_MEAN,
    STD_DEV_T,
    STEP_STD,
    LossInputs,
    LossOutput,
)
from omnirl.trainer.algorithms.grpo_guard import (
    check_log_probs,
    mean_sq_diff,
    reference_kl,
    require,
)
from omnirl.trainer.algorithms.registry import AlgorithmSpec, register_algorithm, register_loss


def step_kl(
    mean: torch.Tensor,
    old_mean: torch.Tensor,
    step_std: torch.Tensor,
    *,
    add_kl_coefficient: bool = True,
) -> torch.Tensor:
    """Per-sample ``KL(new || old)`` of two Gaussian steps of one std, averaged over latents.

    ``mean``, ``old_mean``: ``[B, ...]``; ``step_std``: ``[B]`` (> 0). Returns ``[B]``.
    """
    msd = mean_sq_diff(mean, old_mean)
    if not add_kl_coefficient:
        return msd / 2.0
    std = step_std.to(torch.float32).reshape(msd.shape[0], -1)[:, 0]
    if not bool((std > 0).all()):
        raise ValueError(f"step KL needs step_std > 0 (a deterministic step has none): {std}")
    return msd / (2.0 * std.pow(2))


@register_loss("flow_dppo")
class FlowDPPOLoss:
    """Unclipped policy gradient with the asymmetric KL trust-region mask."""

    @dataclass(frozen=True, kw_only=True, slots=True)
    class Config:
        kl_mask_threshold: float = 1e-5
        add_kl_coefficient: bool = True
        kl_beta: float = 0.0
        w_max: float = 2.0

        def __post_init__(self) -> None:
            if not self.kl_mask_threshold > 0:
                raise ValueError(f"kl_mask_threshold must be > 0, got {self.kl_mask_threshold!r}")
            if not self.kl_beta >= 0:
                raise ValueError(f"kl_beta must be >= 0, got {self.kl_beta!r}")
            if not self.w_max >= 1:
                raise ValueError(f"w_max must be >= 1, got {self.w_max!r}")

    def __init__(self, config: FlowDPPOLoss.Config | None = None) -> None:
        self.config = config or FlowDPPOLoss.Config()

    def needs(self) -> frozenset[str]:
        base = {LOG_PROB, PROX_LOG_PROB, BEHAV_LOG_PROB, ADVANTAGES}
        base |= {PREV_SAMPLE_MEAN, PROX_PREV_SAMPLE_MEAN, STEP_STD}
        if self.config.kl_beta > 0:
            base |= {REF_PREV_SAMPLE_MEAN, STD_DEV_T}
        return frozenset(base)

    def __call__(self, inputs: LossInputs) -> LossOutput:
        cfg = self.config
        check_log_probs(inputs)
        require(inputs, "flow_dppo", (PREV_SAMPLE_MEAN, PROX_PREV_SAMPLE_MEAN, STEP_STD))
        new, adv = inputs.log_prob, inputs.advantages.detach()
        prox, behav = inputs.prox_log_prob.detach(), inputs.behav_log_prob.detach()
        log_ratio = new - prox
        ratio = torch.exp(log_ratio)
        with torch.no_grad():
            kl_old = step_kl(
                inputs.prev_sample_mean,
                inputs.prox_prev_sample_mean,
                inputs.step_std,
                add_kl_coefficient=cfg.add_kl_coefficient,
            )
            outside = kl_old >= cfg.kl_mask_threshold
            masked = outside & (((ratio > 1.0) & (adv > 0)) | ((ratio < 1.0) & (adv < 0)))
        per_sample_pg = torch.where(masked, torch.zeros_like(ratio), -adv * ratio)
        weight = torch.exp(prox - behav).clamp(max=cfg.w_max)
        policy_loss = (weight * per_sample_pg).mean()
        kl = reference_kl(inputs, cfg.kl_beta, policy_loss)
        loss = policy_loss + cfg.kl_beta * kl
        per_sample = {
            "ratio": ratio.detach(),
            "log_ratio": log_ratio.detach(),
            "clipped": masked.to(torch.float32),  # reported as clip_frac: the masked share
            "importance_weight": weight,
            "kl_new_old": kl_old,
            "outside_trust_region": outside.to(torch.float32),
        }
        return LossOutput(
            loss=loss, policy_loss=policy_loss.detach(), kl=kl.detach(), per_sample=per_sample
        )


register_algorithm(
    AlgorithmSpec(
        name="flow_dppo",
        sde_type="sde",
        advantage="group",
        loss="flow_dppo",
        adapter_algorithm="flow_grpo",
        defaults={
            "adv_clip_max": float("inf"),
            "std": "global",
            "kl_beta": 0.0,
            "kl_mask_threshold": 1e-5,
        },
        sampling_defaults={"sde_type": "sde", "noise_level": 0.7},
        alias_of="flow_grpo",
        description="Flow-DPPO (divergence trust-region mask, no clip), verl-omni flow_dppo",
    )
)
