"""The SD3 transformer's LoRA adapter, built identically by the trainer and the rollout."""

from __future__ import annotations

from typing import Any

import torch

from omnirl.models.weights import lora_targets

# flow_grpo's SD3 targets: every attention projection of the joint blocks.
DEFAULT_TARGET_MODULES: tuple[str, ...] = (
    "attn.add_k_proj",
    "attn.add_q_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "attn.to_k",
    "attn.to_out.0",
    "attn.to_q",
    "attn.to_v",
)


def lora_kwargs(lora: dict[str, Any]) -> dict[str, Any]:
    """``LoraConfig`` kwargs with SD3 defaults filled in, JSON-safe (lists, not tuples)."""
    kwargs = {
        "r": 8,
        "lora_alpha": 16,
        "init_lora_weights": "gaussian",
        "target_modules": list(DEFAULT_TARGET_MODULES),
    }
    kwargs.update(lora)
    if isinstance(kwargs["target_modules"], tuple | set):
        kwargs["target_modules"] = sorted(kwargs["target_modules"])
    return kwargs


def add_lora(
    transformer: torch.nn.Module, lora: dict[str, Any], *, cast_inputs: bool = False
) -> dict[str, Any]:
    """Freeze ``transformer`` and add a LoRA adapter (name ``default``); return its kwargs.

    Only the adapter's parameters require grad afterwards. They are float32 whatever the
    base model's dtype, on the trainer (so optimiser updates are not lost to bf16 rounding)
    and on the rollout alike (so both run the same adapter kernels and agree exactly); a
    half-precision model's call casts them at use (``omnirl.models.device.model_autocast``).

    ``cast_inputs=False`` (the default) stops PEFT from casting each adapted layer's input to
    the adapter's float32 before ``lora_A``: under autocast that copy is cast straight back to
    the model dtype for the matmul, so skipping both copies changes no value (the round trip
    bf16 -> fp32 -> bf16 is exact) and saves two passes over the activations per adapted
    layer, forward and backward. ``True`` is PEFT's behaviour (flow_grpo's; the baseline's).
    Raises ``ValueError`` for ``LoraConfig`` kwargs PEFT does not accept.
    """
    from peft import LoraConfig

    kwargs = lora_kwargs(lora)
    try:
        config = LoraConfig(**kwargs)
    except TypeError as e:
        raise ValueError(f"bad LoRA config {kwargs}: {e}") from e
    transformer.requires_grad_(False)
    transformer.add_adapter(config)
    for param in lora_targets(transformer).values():
        param.data = param.data.to(torch.float32)
    if not cast_inputs:
        from peft.tuners.lora import LoraLayer

        for module in transformer.modules():
            if isinstance(module, LoraLayer):
                module.cast_input_dtype_enabled = False
    return kwargs
