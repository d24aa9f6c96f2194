"""``benchmarks/shapes_group_outcomes.py`` samples every mode and reports group statistics."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "shapes_group_outcomes.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(SCRIPT), str(ROOT / "examples/checkpoints/shapes_t2i"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_every_mode_reports_fractions_in_range():
    proc = _run("--prompts", "2", "--group", "4", "--threads", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [
        line
        for line in proc.stdout.splitlines()
        if line.startswith("| sde") or line.startswith("| ode")
    ]
    assert len(rows) == 3
    for row in rows:
        values = [float(v) for v in row.strip("| ").split(" | ")[1:]]
        assert len(values) == 5 and all(0.0 <= v <= 1.0 for v in values)


def test_a_category_without_prompts_is_refused_by_name():
    proc = _run("--category", "juggling")
    assert proc.returncode != 0 and "no 'juggling' prompts" in proc.stderr
