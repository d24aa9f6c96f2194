"""Diffusion-DPO on a flow-matching model, online: the best and the worst sample of each group.

Wallace et al. 2023, *Diffusion Model Alignment Using Direct Preference Optimization*
(arXiv:2311.12908); code: diffusers ``examples/research_projects/diffusion_dpo`` /
SalesforceAIResearch DiffusionDPO ``train.py``. Per (chosen ``w``, rejected ``l``) pair, one
shared noise ``eps`` and noise level ``t`` (CONVENTIONS), the flow-matching target
``u = eps - x0``:

```
x_t^s  = (1 - t) x0^s + t eps                        s in {w, l}
e^s    = mean((v_theta(x_t^s) - u^s)^2),  e_ref^s the same with the reference policy
loss   = -log sigmoid(-dpo_beta / 2 * ((e^w - e_ref^w) - (e^l - e_ref^l)))
```

The reference is the model with the LoRA disabled (``adapter.reference()``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from omnirl.trainer.algorithms.flow_grpo import LossOutput
from omnirl.trainer.algorithms.registry import AlgorithmSpec, register_algorithm, register_loss


def preference_pair(rewards: Tensor | Sequence[float]) -> tuple[int, int] | None:
    """``(chosen, rejected)`` sample indices of one group, or ``None`` if all rewards tie.

    Ties are broken deterministically: the chosen sample is the *lowest* index among the
    maxima, the rejected one the *lowest* index among the minima.
    """
    r = torch.as_tensor(rewards, dtype=torch.float64).reshape(-1)
    if r.numel() < 2 or bool((r == r[0]).all()):
        return None
    hi, lo = r.max(), r.min()
    chosen = int((r == hi).nonzero()[0])
    rejected = int((r == lo).nonzero()[0])
    return chosen, rejected


def _per_row_mean(x: Tensor) -> Tensor:
    return x.mean(dim=tuple(range(1, x.dim())))


@dataclass(frozen=True, kw_only=True, slots=True)
class DPOLossInputs:
    """``B`` pairs; all float32 ``[B, C, H, W]``. Only the ``v_theta_*`` carry gradients."""

    target_w: Tensor  # eps - x0 of the chosen samples
    target_l: Tensor  # eps - x0 of the rejected samples
    v_theta_w: Tensor
    v_theta_l: Tensor
    v_ref_w: Tensor
    v_ref_l: Tensor


@register_loss("diffusion_dpo")
class DiffusionDPOLoss:
    """Diffusion-DPO's sigmoid loss on flow-matching errors (module docstring)."""

    pairs = True  # ForwardProcessStep feeds it (chosen, rejected) pairs, not samples

    @dataclass(frozen=True, kw_only=True, slots=True)
    class Config:
        dpo_beta: float = 5000.0

        def __post_init__(self) -> None:
            if not self.dpo_beta > 0:
                raise ValueError(f"dpo_beta must be > 0, got {self.dpo_beta!r}")

    def __init__(self, config: DiffusionDPOLoss.Config | None = None) -> None:
        self.config = config or DiffusionDPOLoss.Config()

    def needs_reference(self) -> bool:
        return True

    def needs_old(self) -> bool:
        return False

    def __call__(self, inputs: DPOLossInputs) -> LossOutput:
        shapes = {tuple(t.shape) for t in (inputs.target_w, inputs.target_l, inputs.v_theta_w,
                                           inputs.v_theta_l, inputs.v_ref_w, inputs.v_ref_l)}  # fmt: skip
        if len(shapes) != 1:
            raise ValueError(f"DPO inputs must share one shape; got {sorted(shapes)}")
        e_w = _per_row_mean((inputs.v_theta_w - inputs.target_w).pow(2))
        e_l = _per_row_mean((inputs.v_theta_l - inputs.target_l).pow(2))
        with torch.no_grad():
            ref_w = _per_row_mean((inputs.v_ref_w - inputs.target_w).pow(2))
            ref_l = _per_row_mean((inputs.v_ref_l - inputs.target_l).pow(2))
        inside = -0.5 * self.config.dpo_beta * ((e_w - ref_w) - (e_l - ref_l))  # [B]
        loss = -F.logsigmoid(inside).mean()
        per_sample = {
            "implicit_accuracy": (inside.detach() > 0).to(torch.float32),
            "model_diff": (e_w - e_l).detach(),
            "ref_diff": ref_w - ref_l,
        }
        zero = torch.zeros((), dtype=loss.dtype, device=loss.device)
        return LossOutput(loss=loss, policy_loss=loss.detach(), kl=zero, per_sample=per_sample)


register_algorithm(
    AlgorithmSpec(
        name="diffusion_dpo",
        sde_type="ode",
        advantage="group",  # only to skip tied groups and report adv_abs_mean
        loss="diffusion_dpo",
        adapter_algorithm="flow_grpo",
        needs_log_probs=False,
        defaults={"dpo_beta": 5000.0, "timestep_fraction": 0.99, "std": "global"},
        sampling_defaults={"sde_type": "ode", "noise_level": 0.0},
        description="online Diffusion-DPO (Wallace et al. 2023): best vs worst of each group",
    )
)
