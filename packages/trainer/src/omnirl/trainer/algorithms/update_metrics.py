"""Metrics of one ``TrainStep.step`` call: per-batch statistics and an update accumulator.

Per-sample quantities (ratios, clip indicators, importance weights, the rollout / trainer
log-prob gap) are kept as vectors and reduced once at the end, so ``ratio_std`` is the
spread over every (sample, trained step) pair, not a mean of micro-batch spreads. They stay
on the device they were computed on until :meth:`MetricsAccumulator.summary`, so the
micro-batch loop never waits for the device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from omnirl.protocol.messages import DiffusionTrajectoryGroup


def batch_metrics(
    groups: Sequence[DiffusionTrajectoryGroup],
    rewards: Sequence[torch.Tensor],
    advantages: Sequence[torch.Tensor],
    policy_version: int,
) -> dict[str, float]:
    """Rewards, advantages and staleness over every group handed in (skipped ones too)."""
    r = torch.cat([x.reshape(-1) for x in rewards]).to(torch.float64)
    a = torch.cat([x.reshape(-1) for x in advantages]).to(torch.float64)
    stale = torch.tensor([policy_version - g.policy_version for g in groups], dtype=torch.float64)
    return {
        "reward_mean": float(r.mean()),
        "reward_std": float(r.std(correction=0)),
        "adv_abs_mean": float(a.abs().mean()),
        "staleness_mean": float(stale.mean()),
        "staleness_max": float(stale.max()),
        "num_groups": float(len(groups)),
        "policy_version": float(policy_version),
    }


class MetricsAccumulator:
    """Collects what the optimiser updates of one call produce; :meth:`summary` reduces it."""

    def __init__(self) -> None:
        self.samples: dict[str, list[torch.Tensor]] = {}
        self.parity: list[torch.Tensor] = []
        self.updates: list[dict[str, float]] = []
        self.nonfinite_updates = 0
        self.num_samples = 0
        self.trained_steps = 0

    def set_shape(self, *, num_samples: int, trained_steps: int) -> None:
        self.num_samples, self.trained_steps = num_samples, trained_steps

    def add_samples(self, per_sample: dict[str, torch.Tensor]) -> None:
        for name, value in per_sample.items():
            self.samples.setdefault(name, []).append(value.detach().float().reshape(-1))

    def add_parity(self, prox_minus_behav: torch.Tensor) -> None:
        self.parity.append(prox_minus_behav.detach().float().reshape(-1))

    def add_update(self, *, grad_norm: float, loss: float, policy_loss: float, kl: float) -> None:
        values = {"loss": loss, "policy_loss": policy_loss, "kl": kl}
        self.updates.append({"grad_norm": grad_norm, **{k: float(v) for k, v in values.items()}})

    def to_cpu(self) -> MetricsAccumulator:
        """Move the collected vectors to the CPU, one concatenated vector per name."""
        self.samples = {k: [torch.cat(v).cpu()] for k, v in self.samples.items() if v}
        self.parity = [torch.cat(self.parity).cpu()] if self.parity else []
        return self

    def merge(self, others: Sequence[MetricsAccumulator]) -> MetricsAccumulator:
        """Append the per-sample vectors of ``others`` (other ranks' shares of the same
        updates); update totals and counts are this accumulator's (already global)."""
        for other in others:
            for name, parts in other.samples.items():
                self.samples.setdefault(name, []).extend(parts)
            self.parity.extend(other.parity)
        return self

    def _cat(self, name: str) -> torch.Tensor | None:
        parts = self.samples.get(name)
        return torch.cat([p.cpu() for p in parts]) if parts else None

    def summary(self) -> dict[str, float]:
        out = {
            "loss": 0.0,
            "policy_loss": 0.0,
            "kl": 0.0,
            "grad_norm": 0.0,
            "ratio_mean": 1.0,
            "ratio_std": 0.0,
            "clip_frac": 0.0,
            "approx_kl": 0.0,
            "importance_weight_mean": 1.0,
            "behav_prox_logp_absdiff_mean": 0.0,
            "behav_prox_logp_absdiff_max": 0.0,
            "num_samples": float(self.num_samples),
            "trained_steps": float(self.trained_steps),
            "optimizer_steps": float(len(self.updates) - self.nonfinite_updates),
            "nonfinite_updates": float(self.nonfinite_updates),
        }
        finite = [u for u in self.updates if torch.isfinite(torch.tensor(u["grad_norm"]))]
        for key in ("loss", "policy_loss", "kl", "grad_norm"):
            if finite:
                out[key] = sum(u[key] for u in finite) / len(finite)
        ratio = self._cat("ratio")
        if ratio is not None:
            out["ratio_mean"] = float(ratio.mean())
            out["ratio_std"] = float(ratio.std(correction=0))
        clipped = self._cat("clipped")
        if clipped is not None:
            out["clip_frac"] = float(clipped.mean())
        log_ratio = self._cat("log_ratio")
        if log_ratio is not None:  # flow_grpo's approx_kl: 0.5 * mean((logp - logp_prox)^2)
            out["approx_kl"] = float(0.5 * log_ratio.pow(2).mean())
        weight = self._cat("importance_weight")
        if weight is not None:
            out["importance_weight_mean"] = float(weight.mean())
        if self.parity:
            gap = torch.cat([p.cpu() for p in self.parity]).abs()
            out["behav_prox_logp_absdiff_mean"] = float(gap.mean())
            out["behav_prox_logp_absdiff_max"] = float(gap.max())
        return out
