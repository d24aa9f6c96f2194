"""``benchmarks/rollout_lora_mode.py`` runs and reports both sides and their agreement."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_lora_mode_benchmark_reports_both_sides():
    cmd = [sys.executable, str(ROOT / "benchmarks" / "rollout_lora_mode.py"), "--repeats", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| branch (`--lora-mode adapter`) |" in proc.stdout
    assert "| merged (`--lora-mode merged`" in proc.stdout
    rel = float(re.search(r"relative difference ([0-9.e+-]+)", proc.stdout).group(1))
    assert rel < 1e-5  # the merged rollout samples what the branch samples
