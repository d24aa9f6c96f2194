"""``benchmarks/shapes_run_spread.py``: per-category spread of the held-out gain across runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "shapes_run_spread.py"

CATS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")


@pytest.fixture
def spread(benchmark_script):
    return benchmark_script("shapes_run_spread").spread


def _curve(folder: Path, gains: dict[str, float]) -> Path:
    """A run folder whose curve.json has the base and one checkpoint scored against it."""
    overall = float(np.mean([gains[c] for c in CATS]))
    rows = [
        {"step": 0, "overall": {"strict": 0.3}},
        {
            "step": 100,
            "overall": {"strict": 0.3 + overall},
            "gain_vs_base": {
                "overall": {"gain": overall, "ci95": [0, 0]},
                "categories": {c: {"gain": gains[c], "ci95": [0, 0]} for c in CATS},
            },
        },
    ]
    (folder / "curve").mkdir(parents=True)
    (folder / "curve" / "curve.json").write_text(json.dumps(rows))
    return folder


def test_one_moving_category_carries_all_of_the_spread(spread):
    gains = [{c: 0.2 for c in CATS} | {"two_object": g} for g in (0.1, 0.4, 0.7)]
    for g in gains:
        g["overall"] = float(np.mean([g[c] for c in CATS]))
    stats = spread(gains)
    assert stats["two_object"]["share"] == pytest.approx(1.0)
    assert stats["counting"]["share"] == pytest.approx(0.0)
    assert stats["two_object"]["sd"] == pytest.approx(0.3)
    assert stats["overall"]["sd"] == pytest.approx(0.3 / 6)
    assert stats["two_object"]["mean"] == pytest.approx(0.4)


def test_shares_add_to_one_and_co_movement_is_shared(spread):
    rng = np.random.default_rng(0)
    gains = []
    for _ in range(8):
        common = rng.normal()
        g = {c: 0.2 + 0.05 * common + 0.02 * rng.normal() for c in CATS}
        g["overall"] = float(np.mean(list(g.values())))
        gains.append(g)
    shares = [spread(gains)[c]["share"] for c in CATS]
    assert sum(shares) == pytest.approx(1.0)
    assert all(0.05 < s < 0.35 for s in shares)  # each category moves with the others


def test_the_script_reads_run_folders_and_prints_the_table(tmp_path):
    runs = [
        _curve(tmp_path / f"run{i}", {c: 0.2 for c in CATS} | {"position": p})
        for i, p in enumerate((0.0, 0.12))
    ]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, runs)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[2].startswith("| run0 | +0.200 ") and lines[3].startswith("| run1 |")
    share = lines[-1].split(" | ")
    assert share[0] == "| share" and share[5] == "1.00"  # position is the fifth category


def test_bad_input_is_refused_by_name(tmp_path):
    one = _curve(tmp_path / "a", {c: 0.2 for c in CATS})
    proc = subprocess.run([sys.executable, str(SCRIPT), str(one)], capture_output=True, text=True)
    assert proc.returncode != 0 and "at least two runs" in proc.stderr
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(one), str(tmp_path / "absent")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0 and "absent" in proc.stderr
