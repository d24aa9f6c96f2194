"""``benchmarks/shapes_colour_scores.py``: the reward's scores per colour where none is named."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "shapes_colour_scores.py"


def test_scores_per_colour_of_the_base_and_of_renders(tmp_path):
    out = tmp_path / "colours.json"
    cmd = [sys.executable, str(SCRIPT), "examples/checkpoints/shapes_t2i", "--limit", "6"]
    cmd += ["--seeds", "2", "--threads", "1", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["n_prompts"] == 6
    colours = ["red", "yellow", "green", "cyan", "blue", "purple"]
    assert list(result["model"]) == colours
    assert 0 < sum(r["images"] for r in result["model"].values()) <= 12
    for row in result["model"].values():
        assert row["images"] == 0 or 0 <= row["strict"] <= row["partial"] <= 1
        assert row["images"] > 0 or math.isnan(row["strict"])
    # clean renders pass in every colour; noise costs some
    assert all(r["strict"] == 1.0 for r in result["rendered_clean"].values())
    assert min(r["partial"] for r in result["rendered_noisy"].values()) < 1.0
    assert "red" in proc.stdout
