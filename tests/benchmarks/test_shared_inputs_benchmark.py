"""``benchmarks/shared_inputs.py`` runs both sides of the rollout and the training work."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_shared_inputs_benchmark_reports_rollout_and_training():
    cmd = [sys.executable, str(ROOT / "benchmarks" / "shared_inputs.py"), "--repeats", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = re.findall(
        r"^\| (rollout|training)[^|]*\| ([0-9.]+) \| ([0-9.]+) \| ([0-9.]+)x \|$",
        proc.stdout,
        flags=re.MULTILINE,
    )
    assert [r[0] for r in rows] == ["rollout", "training"], proc.stdout
    assert all(float(v) > 0 for r in rows for v in r[1:])
