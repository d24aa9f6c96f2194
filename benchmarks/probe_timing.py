"""Wall-clock timing for the kernel probes (`attention_probe.py`, `vae_decode_probe.py`,
`float8_matmul_shapes.py`, `norm_quant_probe.py`): seconds per call of a function on a
device, synchronised; and their results as JSONL after an ``env`` row."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

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


def write_results(out: str | Path, name: str, device: torch.device, rows: list[dict]) -> Path:
    """``<out>/<name>.jsonl``: an ``env`` row (torch, device, GPU name) then ``rows``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    env = {"stage": "env", "torch": torch.__version__, "device": str(device)}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    path = out / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [env, *rows]))
    return path
