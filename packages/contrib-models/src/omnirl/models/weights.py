"""LoRA / full weight export and atomic application, shared by training and rollout adapters.

Names on the wire:

- ``"lora"``: PEFT state-dict keys, i.e. the module's parameter names with the adapter name
  removed (``blocks.0.attn.to_q.lora_A.weight``), exactly what
  ``peft.get_peft_model_state_dict`` returns and what diffusers' ``save_lora_weights`` takes.
- ``"full"``: the module's own ``state_dict()`` keys (parameters and persistent buffers).

:func:`apply_named_tensors` checks every name, shape, dtype and value first and copies only
when all are good, so a bad update leaves the module untouched.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from omnirl.models.base import WeightLoadError

DEFAULT_ADAPTER = "default"


def lora_targets(module: nn.Module, adapter_name: str = DEFAULT_ADAPTER) -> dict[str, Tensor]:
    """PEFT key -> the live parameter of adapter ``adapter_name`` (LoRA A/B, DoRA magnitude)."""
    marker = f".{adapter_name}."
    targets = {}
    for name, param in module.named_parameters():
        if "lora_" in name and marker in name:
            targets[name.replace(marker, ".", 1)] = param
    return targets


def _cpu_copy(t: Tensor) -> Tensor:
    """A detached, contiguous CPU copy of the whole tensor (a sharded DTensor, e.g. under
    FSDP2, is gathered first: a collective, so every rank must call the export)."""
    t = t.detach()
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.to("cpu", copy=True).contiguous()


def lora_state(module: nn.Module, adapter_name: str = DEFAULT_ADAPTER) -> dict[str, Tensor]:
    """The adapter's tensors under PEFT keys: detached, contiguous CPU copies."""
    targets = lora_targets(module, adapter_name)
    if not targets:
        raise WeightLoadError(f"module has no LoRA adapter named {adapter_name!r}")
    return {k: _cpu_copy(v) for k, v in targets.items()}


def full_targets(module: nn.Module) -> dict[str, Tensor]:
    """``state_dict`` key -> the live parameter or buffer."""
    return dict(module.state_dict(keep_vars=True))


def full_state(module: nn.Module) -> dict[str, Tensor]:
    """Every weight of ``module`` under its ``state_dict`` key: detached, contiguous CPU copies."""
    return {k: _cpu_copy(v) for k, v in full_targets(module).items()}


def validate_named_tensors(
    targets: Mapping[str, Tensor], tensors: Mapping[str, Tensor], *, strict: bool = True
) -> None:
    """Raise :class:`WeightLoadError` listing every problem of ``tensors`` against ``targets``.

    Checked: unknown names, missing names (when ``strict``), shapes, float-vs-integer dtype
    kinds (floating tensors may differ in precision: they are cast on copy), finiteness.
    """
    problems: list[str] = []
    unknown = sorted(set(tensors) - set(targets))
    if unknown:
        problems.append(f"unknown names ({len(unknown)}): {unknown[:5]}")
    if strict:
        missing = sorted(set(targets) - set(tensors))
        if missing:
            problems.append(f"missing names ({len(missing)}): {missing[:5]}")
    for name, value in tensors.items():
        target = targets.get(name)
        if target is None:
            continue
        if not isinstance(value, Tensor):
            problems.append(f"{name}: not a tensor ({type(value).__name__})")
            continue
        if tuple(value.shape) != tuple(target.shape):
            problems.append(f"{name}: shape {tuple(value.shape)}, expected {tuple(target.shape)}")
            continue
        if value.dtype.is_floating_point != target.dtype.is_floating_point:
            problems.append(f"{name}: dtype {value.dtype}, expected {target.dtype}")
            continue
        if value.dtype.is_floating_point and not bool(torch.isfinite(value).all()):
            problems.append(f"{name}: holds NaN or inf")
    if problems:
        raise WeightLoadError("weight update refused, model unchanged: " + "; ".join(problems))


@torch.no_grad()
def apply_named_tensors(
    targets: Mapping[str, Tensor], tensors: Mapping[str, Tensor], *, strict: bool = True
) -> None:
    """Validate ``tensors`` against ``targets`` (see :func:`validate_named_tensors`), then copy
    each into its live tensor in place (cast to the target's dtype and device)."""
    validate_named_tensors(targets, tensors, strict=strict)
    for name, value in tensors.items():
        targets[name].copy_(value)
