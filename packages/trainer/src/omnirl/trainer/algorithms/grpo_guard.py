"""GRPO-Guard (Wang et al. 2025, arXiv 2510.22319): ratio normalisation and step reweighting.

Flow-GRPO's per-step log-ratio of two Gaussians with means ``mu_new``, ``mu_old`` and one
std ``s`` has, under the old policy, the mean ``-mean((mu_new - mu_old)^2) / (2 s^2)``: a
negative bias whose size and spread depend on the step, so a fixed clip range clips some
steps far more than others. GRPO-Guard removes the bias and rescales, per (sample, step)
in a micro-batch of one step index (``B`` rows):

``scale = mean_B(std_dev_t) * mean_B(sqrt(-dt))``           (one scalar: the step std)
``bias  = mean_latent((mu_new - mu_prox)^2) / (2 * scale^2)``        ``[B]``
``ratio = exp((logp_new - logp_prox + bias) * scale)``                ``[B]``
``policy_loss = mean(w * max(-A * ratio, -A * clip(ratio, 1-eps, 1+eps))) / mean_B(sqrt(-dt))^2``

with ``w`` the truncated behaviour weight of the decoupled objective
(:mod:`~omnirl.trainer.algorithms.flow_grpo`). This is the form of verl-omni's
``grpo_guard`` loss (see CONVENTIONS.md): the batch-mean std and ``sqrt(-dt)`` are folded
into one scale and the loss is divided by ``mean(sqrt(-dt))^2`` (the step reweighting).
Advantages are clamped as FlowGRPO's. The optional KL to the reference is FlowGRPO's.
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
    SQRT_DT,
    STD_DEV_T,
    LossInputs,
    LossOutput,
)
from omnirl.trainer.algorithms.kl import flow_grpo_kl
from omnirl.trainer.algorithms.registry import AlgorithmSpec, register_algorithm, register_loss


def check_log_probs(inputs: LossInputs) -> None:
    """All of ``log_prob``, ``prox_log_prob``, ``behav_log_prob``, ``advantages`` are ``[B]``."""
    shapes = [
        tuple(t.shape)
        for t in (inputs.log_prob, inputs.prox_log_prob, inputs.behav_log_prob, inputs.advantages)
    ]
    if len(set(shapes)) != 1 or len(shapes[0]) != 1:
        raise ValueError(
            f"log_prob, prox_log_prob, behav_log_prob and advantages must all be [B]; got {shapes}"
        )


def require(inputs: LossInputs, loss: str, names: tuple[str, ...]) -> None:
    missing = [n for n in names if getattr(inputs, n) is None]
    if missing:
        raise ValueError(f"loss {loss!r} needs {missing} in its LossInputs")


def mean_sq_diff(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``mean over latent elements of (a - b)^2``: ``[B, ...]`` x2 -> ``[B]`` float32."""
    if a.shape != b.shape:
        raise ValueError(f"step means differ in shape: {tuple(a.shape)} vs {tuple(b.shape)}")
    diff = a.to(torch.float32) - b.to(torch.float32)
    return diff.pow(2).reshape(a.shape[0], -1).mean(dim=1)


def reference_kl(inputs: LossInputs, kl_beta: float, like: torch.Tensor) -> torch.Tensor:
    """FlowGRPO's mean KL to the reference when ``kl_beta > 0``, else a zero scalar."""
    if kl_beta <= 0:
        return torch.zeros((), dtype=like.dtype, device=like.device)
    require(inputs, "kl", (PREV_SAMPLE_MEAN, REF_PREV_SAMPLE_MEAN, STD_DEV_T))
    return flow_grpo_kl(
        inputs.prev_sample_mean, inputs.ref_prev_sample_mean.detach(), inputs.std_dev_t
    ).mean()


@register_loss("grpo_guard")
class GRPOGuardLoss:
    """PPO-clip on the bias-corrected, step-scaled ratio; loss divided by ``mean(sqrt(-dt))^2``."""

    @dataclass(frozen=True, kw_only=True, slots=True)
    class Config:
        clip_range: float = 1e-4
        kl_beta: float = 0.0
        w_max: float = 2.0

        def __post_init__(self) -> None:
            if not self.clip_range > 0:
                raise ValueError(f"clip_range must be > 0, got {self.clip_range!r}")
            if not self.kl_beta >= 0:
                raise ValueError(f"kl_beta must be >= 0, got {self.kl_beta!r}")
            if not self.w_max >= 1:
                raise ValueError(f"w_max must be >= 1, got {self.w_max!r}")

    def __init__(self, config: GRPOGuardLoss.Config | None = None) -> None:
        self.config = config or GRPOGuardLoss.Config()

    def needs(self) -> frozenset[str]:
        base = {LOG_PROB, PROX_LOG_PROB, BEHAV_LOG_PROB, ADVANTAGES}
        base |= {PREV_SAMPLE_MEAN, PROX_PREV_SAMPLE_MEAN, STD_DEV_T, SQRT_DT}
        if self.config.kl_beta > 0:
            base |= {REF_PREV_SAMPLE_MEAN}
        return frozenset(base)

    def __call__(self, inputs: LossInputs) -> LossOutput:
        cfg = self.config
        check_log_probs(inputs)
        require(inputs, "grpo_guard", (PREV_SAMPLE_MEAN, PROX_PREV_SAMPLE_MEAN, STD_DEV_T, SQRT_DT))
        new, adv = inputs.log_prob, inputs.advantages
        prox, behav = inputs.prox_log_prob.detach(), inputs.behav_log_prob.detach()
        sqrt_dt = inputs.sqrt_dt.to(torch.float32).reshape(-1).mean()
        scale = inputs.std_dev_t.to(torch.float32).reshape(-1).mean() * sqrt_dt
        if not bool(scale > 0):
            raise ValueError("grpo_guard needs a stochastic step (std_dev_t * sqrt(-dt) > 0)")
        bias = mean_sq_diff(inputs.prev_sample_mean, inputs.prox_prev_sample_mean.detach()) / (
            2.0 * scale.pow(2)
        )
        log_ratio = (new - prox + bias) * scale
        ratio = torch.exp(log_ratio)
        clipped_ratio = ratio.clamp(1.0 - cfg.clip_range, 1.0 + cfg.clip_range)
        per_sample_pg = torch.maximum(-adv * ratio, -adv * clipped_ratio)
        weight = torch.exp(prox - behav).clamp(max=cfg.w_max)
        policy_loss = (weight * per_sample_pg).mean() / sqrt_dt.pow(2)
        kl = reference_kl(inputs, cfg.kl_beta, policy_loss)
        loss = policy_loss + cfg.kl_beta * kl
        per_sample = {
            "ratio": ratio.detach(),
            "log_ratio": log_ratio.detach(),
            "clipped": ((ratio.detach() - 1.0).abs() > cfg.clip_range).to(torch.float32),
            "importance_weight": weight,
            "ratio_bias": bias.detach(),
        }
        return LossOutput(
            loss=loss, policy_loss=policy_loss.detach(), kl=kl.detach(), per_sample=per_sample
        )


register_algorithm(
    AlgorithmSpec(
        name="grpo_guard",
        sde_type="sde",
        advantage="group",
        loss="grpo_guard",
        adapter_algorithm="flow_grpo",
        defaults={"clip_range": 1e-4, "adv_clip_max": 5.0, "std": "global", "kl_beta": 0.0},
        sampling_defaults={"sde_type": "sde", "noise_level": 0.7},
        alias_of="flow_grpo",
        description="GRPO-Guard (Wang et al. 2025, arXiv 2510.22319), verl-omni grpo_guard",
    )
)
