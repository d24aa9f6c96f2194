"""Per-step rollout tensors copied to host memory while the denoising loop goes on.

A rollout ships its recorded transitions over the wire, so they end on the host. Copying
each step's tensors as the step produces them (into page-locked memory, without waiting)
lets the copy engine move them while the device computes the next step; stacking them on
the device and copying the stack at the end of the loop costs a stack, a wait for the
device and a copy at pageable-memory speed after the last step instead.

Read the buffers only after :func:`omnirl.models.device.synchronize` (the copies are
asynchronous on an accelerator). On a CPU the copies are plain ones.
"""

from __future__ import annotations

import torch
from torch import Tensor


class HostSteps:
    """``K`` recorded steps of named tensors, as host tensors ``[B, K, *S]``.

    ``record(name, k, t)`` queues the copy of ``t [B, *S]`` (on the rollout's device) into
    step ``k`` of the host buffer ``name``; :meth:`get` returns ``[B, K, *S]`` (a strided
    view of the ``[K, B, *S]`` buffer: copy a row range before handing it on).
    """

    def __init__(self, steps: int, device: torch.device):
        if steps < 0:
            raise ValueError(f"steps must be >= 0, got {steps}")
        self.steps, self.device = steps, device
        self._buffers: dict[str, Tensor] = {}

    def record(self, name: str, k: int, t: Tensor) -> None:
        if not 0 <= k < self.steps:
            raise IndexError(f"step {k} outside the {self.steps} recorded steps")
        buf = self._buffers.get(name)
        if buf is None:
            buf = torch.empty(
                (self.steps, *t.shape), dtype=t.dtype, pin_memory=self.device.type != "cpu"
            )
            self._buffers[name] = buf
        elif buf.shape[1:] != t.shape or buf.dtype != t.dtype:
            raise ValueError(
                f"{name}: step {k} is {tuple(t.shape)} {t.dtype}, earlier steps "
                f"{tuple(buf.shape[1:])} {buf.dtype}"
            )
        buf[k].copy_(t.detach(), non_blocking=True)

    def get(self, name: str) -> Tensor:
        """``[B, K, *S]`` host view of every recorded step of ``name``."""
        return self._buffers[name].transpose(0, 1)

    def __contains__(self, name: str) -> bool:
        return name in self._buffers
