"""``benchmarks/weight_push.py --model tiny``: full and LoRA versions of a real (tiny) SD3
transformer reach a receiver process over loopback TCP in several chunks, are applied by
``SD3RolloutAdapter.load_weights`` and verified byte for byte against the pushed update."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_tiny_model_push_is_applied_and_verified():
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "weight_push.py"),
        "--model",
        "tiny",
        "--repeats",
        "2",
        "--full-repeats",
        "1",
        "--chunk-mb",
        "0.05",  # the tiny full update (0.27 MB) travels in several chunks
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    header, pushes = rows[0], rows[1:]
    assert header["model"] == "tiny" and header["receiver_build_s"] > 0
    assert [r["format"] for r in pushes] == ["full", "lora", "lora"]
    # version 2 is the untimed LoRA version that makes the receiver add its adapter
    assert [r["version"] for r in pushes] == [1, 3, 4]
    for r in pushes:
        assert r["verified"] is True
        assert 0 < r["prepare_s"] <= r["received_s"] <= r["applied_s"]
        assert r["gb_per_s"] > 0
    full, lora = pushes[0], pushes[1]
    assert full["chunks"] > 1 and full["bytes"] > lora["bytes"]
    assert full["tensors"] == 117 and lora["tensors"] == 46  # state_dict / PEFT A, B keys
    assert "| full | 117 |" in proc.stdout and "| lora | 46 |" in proc.stdout
