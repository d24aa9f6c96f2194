"""Device and numeric settings shared by the rollout and the trainer.

The model runs in its dtype (bf16 on a GPU); the scheduler, latents and log-probs stay
float32 (``docs/algorithms.md``, "Numerics"). In a bf16 model the only float32 matmuls
left are the LoRA adapter's (its weights are kept float32 on both sides): on a CUDA device
:func:`configure_matmul` lets them use TF32 tensor cores, about 8x faster than full float32
and, at 10 mantissa bits, still finer than the bf16 (7 bits) base model around them.
Rollout and trainer call it alike, so both run the same kernels.
"""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; raises ``ValueError`` naming the known ones."""
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; known: {sorted(DTYPES)}")
    return DTYPES[name]


def resolve_device(name: str | torch.device) -> torch.device:
    """``"cuda"`` -> the current CUDA device (``cuda:N``); anything else as given.

    Raises ``ValueError`` for a CUDA device when CUDA is not available.
    """
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r} asked for, but CUDA is not available")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


def configure_matmul(device: torch.device | str, dtype: torch.dtype | str) -> bool:
    """TF32 for the float32 matmuls of a half-precision model on CUDA; returns whether set.

    Left alone under ``torch.use_deterministic_algorithms`` (``trainer --deterministic``).
    """
    device, dtype = torch.device(device), resolve_dtype(dtype)
    if device.type != "cuda" or dtype == torch.float32:
        return False
    if torch.are_deterministic_algorithms_enabled():
        return False
    torch.backends.cuda.matmul.allow_tf32 = True
    return True
