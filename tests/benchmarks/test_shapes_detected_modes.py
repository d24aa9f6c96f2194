"""``benchmarks/shapes_detected_modes.py``: the detector's shape multisets per checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "shapes_detected_modes.py"
BASE = "examples/checkpoints/shapes_t2i"


def _run(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(SCRIPT), BASE, "--threads", "1", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)


def test_modes_of_the_base_model_on_both_prompt_files(tmp_path):
    out = tmp_path / "modes.json"
    proc = _run("--limit", "3", "--seeds", "2", "--top", "3", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert [r["prompts"] for r in rows] == ["heldout", "train"]
    held, train = rows
    # the held-out pair is never a training pair
    assert held["asked"] == ["circle+triangle"]
    assert "circle+triangle" not in train["asked"]
    for row in rows:
        assert row["images"] == 6 and 0 <= row["strict"] <= 1
        counts = [count for _, count in row["modes"]]
        assert len(counts) <= 3 and counts == sorted(counts, reverse=True)
        assert 0 < sum(counts) <= row["images"]
    assert f"{BASE} | heldout (circle+triangle) | strict" in proc.stdout


def test_a_category_without_prompts_is_named():
    proc = _run("--category", "three_objects")
    assert proc.returncode != 0
    assert "no 'three_objects' prompts" in proc.stderr
