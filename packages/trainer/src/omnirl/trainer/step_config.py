"""The hyper-parameters of a training step (``TrainStep.Config``) and the fallbacks of the
fields an algorithm may set."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from omnirl.trainer.algorithms.registry import AlgorithmSpec

# Fallbacks for the fields an algorithm may set (AlgorithmSpec.defaults), used when
# neither the caller nor the algorithm gives a value.
_FALLBACKS: dict[str, Any] = {
    "clip_range": 1e-4,
    "adv_clip_max": 5.0,
    "std": "global",
    "kl_beta": 0.0,
    "w_max": 2.0,
    "timestep_fraction": 1.0,
    "timestep_selection": "first",
    "kl_mask_threshold": 1e-5,  # Flow-DPPO's trust region
    # forward-process objectives (omnirl.trainer.forward_step)
    "nft_beta": 1.0,  # DiffusionNFT's mixing strength
    "old_decay_rate": 0.001,  # DiffusionNFT's lagging policy: decay = min(rate * n, max)
    "old_decay_max": 0.5,
    "dpo_beta": 5000.0,  # Diffusion-DPO's inverse temperature
}


@dataclass(kw_only=True, slots=True)
class TrainStepConfig:
    """Hyper-parameters; ``None`` means the algorithm's default (``AlgorithmSpec.defaults``).

    ``adv_clip_max = inf`` disables the advantage clamp; ``micro_batch_size = 0`` backs up
    a whole update's samples at once; ``ema_decay`` None or 0 turns the EMA off;
    ``max_grad_norm`` None or 0 turns clipping off (the norm is still reported).
    """

    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 1e-4
    adam_eps: float = 1e-8
    clip_range: float | None = None
    adv_clip_max: float | None = None
    std: str | None = None  # "group" | "global"
    kl_beta: float | None = None
    w_max: float | None = None  # truncation of the behaviour importance weight
    max_grad_norm: float | None = 1.0
    timestep_fraction: float | None = None  # of the recorded steps, in (0, 1]
    timestep_selection: str | None = None  # "first" | "random"
    kl_mask_threshold: float | None = None  # Flow-DPPO: per-step KL(new || prox) bound
    nft_beta: float | None = None  # DiffusionNFT (forward_step.py)
    old_decay_rate: float | None = None  # DiffusionNFT's lagging old policy
    old_decay_max: float | None = None
    dpo_beta: float | None = None  # Diffusion-DPO (forward_step.py)
    micro_batch_size: int = 0
    inner_epochs: int = 1
    num_minibatches: int = 1  # optimiser updates per inner epoch
    ema_decay: float | None = None
    ema_warmup: bool = True
    seed: int = 0

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], *, ignore: Sequence[str] = ()) -> TrainStepConfig:
        """Build from a mapping (e.g. a config section); unknown keys are refused by name."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names - set(ignore))
        if unknown:
            raise TypeError(f"unknown TrainStep.Config keys {unknown}; known: {sorted(names)}")
        return cls(**{k: v for k, v in values.items() if k in names})

    def resolve(self, spec: AlgorithmSpec) -> TrainStepConfig:
        """A copy with every ``None`` filled from ``spec.defaults``, then the fallbacks."""
        bad = sorted(set(spec.defaults) - set(_FALLBACKS))
        if bad:
            raise TypeError(
                f"algorithm {spec.name!r} sets TrainStep fields {bad}; an algorithm may "
                f"set only {sorted(_FALLBACKS)}"
            )
        filled = {
            name: spec.defaults.get(name, fallback)
            for name, fallback in _FALLBACKS.items()
            if getattr(self, name) is None
        }
        out = dataclasses.replace(self, **filled)
        out._validate()
        return out

    def _validate(self) -> None:
        checks = {
            "std": self.std in ("group", "global"),
            "timestep_selection": self.timestep_selection in ("first", "random"),
            "timestep_fraction": 0 < self.timestep_fraction <= 1,
            "adv_clip_max": self.adv_clip_max > 0,
            "micro_batch_size": self.micro_batch_size >= 0,
            "inner_epochs": self.inner_epochs >= 1,
            "num_minibatches": self.num_minibatches >= 1,
            "ema_decay": self.ema_decay is None or 0 <= self.ema_decay < 1,
            "max_grad_norm": self.max_grad_norm is None or self.max_grad_norm >= 0,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ValueError(
                "TrainStep.Config out of range: "
                + ", ".join(f"{n}={getattr(self, n)!r}" for n in bad)
            )
