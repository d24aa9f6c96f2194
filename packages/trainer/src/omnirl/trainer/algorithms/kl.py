"""KL penalty to the reference policy, as flow_grpo computes it.

``kl_i = mean_over_latent((mu_theta_i - mu_ref_i)^2) / (2 * std_dev_t_i^2)``

``mu`` is the SDE step's mean (``prev_sample_mean``) under the policy and under the
reference (the same model with the LoRA adapter disabled), and ``std_dev_t`` the
scheduler's returned noise scale, which for the ``sde`` step excludes ``sqrt(-dt)``. This is
therefore not the exact Gaussian KL of the step (that would divide by the step variance
``(std_dev_t * sqrt(-dt))^2`` and sum over latent elements); it is flow_grpo's term,
kept so that its ``beta`` values carry over. See ``docs/algorithms.md`` ("Losses").
"""

from __future__ import annotations

import torch


def flow_grpo_kl(
    prev_sample_mean: torch.Tensor,
    ref_prev_sample_mean: torch.Tensor,
    std_dev_t: torch.Tensor,
) -> torch.Tensor:
    """Per-sample KL term ``[B]``.

    Args:
        prev_sample_mean: ``[B, ...]`` float32 step mean under the policy (carries grad).
        ref_prev_sample_mean: ``[B, ...]`` float32 step mean under the reference.
        std_dev_t: ``[B]`` (or broadcastable, e.g. ``[B, 1, 1, 1]``) float32, > 0.
    """
    if prev_sample_mean.shape != ref_prev_sample_mean.shape:
        raise ValueError(
            f"policy and reference means differ in shape: "
            f"{tuple(prev_sample_mean.shape)} vs {tuple(ref_prev_sample_mean.shape)}"
        )
    batch = prev_sample_mean.shape[0]
    std = std_dev_t.to(torch.float32).reshape(batch, -1)[:, 0]
    if not bool((std > 0).all()):
        raise ValueError(
            "KL to the reference needs std_dev_t > 0 (a deterministic ODE step has none); "
            f"got {std.tolist()}"
        )
    diff = prev_sample_mean.to(torch.float32) - ref_prev_sample_mean.to(torch.float32)
    return diff.pow(2).reshape(batch, -1).mean(dim=1) / (2.0 * std.pow(2))
