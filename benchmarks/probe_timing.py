"""Wall-clock timing for the kernel probes (`attention_probe.py`, `vae_decode_probe.py`,
`float8_matmul_shapes.py`): seconds per call of a function on a device, synchronised."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (nothing to wait for on a CPU)."""
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def seconds_per_call(
    fn: Callable[[], object],
    device: torch.device,
    seconds: float,
    *,
    warmup: int = 3,
    batch: int = 5,
    min_calls: int = 5,
) -> float:
    """Seconds per call of ``fn``: ``warmup`` calls, then batches of ``batch`` calls until
    ``seconds`` have passed and at least ``min_calls`` ran, synchronising after each batch."""
    for _ in range(warmup):
        fn()
    sync(device)
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds or calls < min_calls:
        for _ in range(batch):
            fn()
        calls += batch
        sync(device)
    return (time.perf_counter() - start) / calls
