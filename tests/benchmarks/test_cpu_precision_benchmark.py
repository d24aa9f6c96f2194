"""``benchmarks/cpu_precision.py`` measures all four sides of rollout and training work."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_cpu_precision_benchmark_reports_every_side_and_the_attention_kernel():
    cmd = [sys.executable, str(ROOT / "benchmarks" / "cpu_precision.py"), "--repeats", "1"]
    # the script's mechanics; the config's sizes (16 a group, 64 a micro-batch) under inductor
    # take minutes, most of it generating kernels
    cmd += ["--group-size", "4", "--micro", "4", "--compile-backend", "aot_eager"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = re.findall(
        r"^\| (float32 eager|bf16 eager|float32 compiled|bf16 compiled) \| ([0-9.]+) \| "
        r"([0-9.]+)x \| ([0-9.]+) \| ([0-9.]+)x \|",
        proc.stdout,
        flags=re.MULTILINE,
    )
    assert [r[0] for r in rows] == [
        "float32 eager",
        "bf16 eager",
        "float32 compiled",
        "bf16 compiled",
    ], proc.stdout
    assert all(float(v) > 0 for r in rows for v in r[1:])
    # the float32 eager side is the unit of both ratio columns
    assert float(rows[0][2]) == 1.0 and float(rows[0][4]) == 1.0
    assert re.search(r"bf16 [0-9.]+ ms, float32 [0-9.]+ ms \([0-9.]+x\)", proc.stdout)
