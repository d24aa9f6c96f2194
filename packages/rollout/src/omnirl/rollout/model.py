"""The rollout model of a worker: the registered rollout adapter, built from the Welcome.

Runs only on the sampler thread. torch and the model stack are imported here, lazily, so
that ``rollout --help`` stays light.
"""

from __future__ import annotations

import logging
from typing import Any

from omnirl.protocol.messages import Lease, Welcome
from omnirl.rollout.weights_inbox import ReadyUpdate

log = logging.getLogger("omnirl.rollout")


def algorithm_of(welcome: Welcome) -> str:
    """The run's algorithm name from the Welcome's config (``algorithm.name``), else ``*``."""
    algorithm = welcome.config.get("algorithm", "*")
    if isinstance(algorithm, dict):
        algorithm = algorithm.get("name", "*")
    return str(algorithm or "*")


def lora_kwargs(welcome: Welcome, update: ReadyUpdate) -> dict[str, Any] | None:
    """PEFT ``LoraConfig`` kwargs for the adapter, or None when weights are full.

    The update's ``adapter_config`` (the training adapter's own) wins; else the trainer
    config's ``model.lora`` (``r``, ``alpha``, ``target_modules``, ``dropout``) is translated.
    """
    if update.format != "lora":
        return None
    if update.adapter_config:
        return dict(update.adapter_config)
    model_cfg = welcome.config.get("model", {})
    lora = model_cfg.get("lora") if isinstance(model_cfg, dict) else None
    if not lora:
        raise ValueError(
            "a LoRA weight update without adapter_config, and no model.lora in the config"
        )
    kwargs: dict[str, Any] = {"r": lora["r"], "lora_alpha": lora.get("alpha", lora["r"])}
    if "target_modules" in lora:
        kwargs["target_modules"] = list(lora["target_modules"])
    if "dropout" in lora:
        kwargs["lora_dropout"] = lora["dropout"]
    return kwargs


class RolloutModel:
    """Holds the adapter and the version it holds."""

    def __init__(self, adapter: Any, *, format: str) -> None:
        self.adapter = adapter
        self.format = format
        self.version = -1

    @classmethod
    def build(
        cls, welcome: Welcome, first: ReadyUpdate, *, device: str, dtype: str
    ) -> RolloutModel:
        """Load ``welcome.model_path`` with the adapter shape the first update needs."""
        import torch

        from omnirl.models.registry import get_rollout_adapter

        torch_dtype = getattr(torch, dtype, None)
        if not isinstance(torch_dtype, torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r}")
        adapter_cls = get_rollout_adapter(welcome.architecture, algorithm_of(welcome))
        adapter = adapter_cls.from_pretrained(
            welcome.model_path, device=device, dtype=torch_dtype, lora=lora_kwargs(welcome, first)
        )
        log.info(
            "built %s for %s on %s (%s, weights %s)",
            adapter_cls.__name__,
            welcome.model_path,
            device,
            dtype,
            first.format,
        )
        return cls(adapter, format=first.format)

    def apply(self, update: ReadyUpdate) -> int:
        """Apply a whole version atomically (the adapter validates before it copies)."""
        if update.format != self.format:
            raise ValueError(f"weights of format {update.format!r} for a {self.format!r} model")
        self.adapter.load_weights(update.format, update.tensors)
        self.version = update.version
        return update.version

    def sample(self, lease: Lease, worker_id: str, version: int) -> list:
        """Sample every prompt group of ``lease`` at the held ``version``."""
        return self.adapter.sample(
            lease.prompts,
            lease.sampling,
            lease_id=lease.lease_id,
            worker_id=worker_id,
            policy_version=version,
        )
