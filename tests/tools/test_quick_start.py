"""The README's quick start, shortened: the ShapesEval example config through `omnirl launch`
(real trainer, rollout and reward processes on loopback) on the committed base checkpoint,
then `shapes_curve` on what it wrote."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "shapes_flow_grpo.yaml"


@pytest.mark.slow
def test_shapes_quick_start_trains_checkpoints_and_scores(tmp_path):
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "omnirl.tools.cli",
        "launch",
        str(CONFIG),
        f"run.output_dir={out}",
        "max_steps=2",
        "train.groups_per_step=2",
        "data.group_size=4",
        "checkpoint.every=1",
        "logging.image_grid_every=1",
        "--rollout",
        "2",  # the README's quick start: two rollout workers
        "--reward",
        "1",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:  # the detector's two components, from the scorer named in the config
        assert 0.0 <= r["reward/shapes_eval.strict"] <= r["reward/shapes_eval.partial"] <= 1.0
    assert (out / "checkpoints").is_dir() and list((out / "images").glob("step_*.png"))

    from omnirl.tools.shapes_curve import main as curve_main

    prompts = ROOT / "examples" / "prompts" / "shapes_heldout.jsonl"
    curve_out = tmp_path / "curve"
    argv = [str(out), "--prompts", str(prompts), "--limit", "6", "--seeds", "1"]
    assert curve_main([*argv, "--threads", "1", "--out", str(curve_out)]) == 0
    curve = json.loads((curve_out / "curve.json").read_text())
    assert [row["step"] for row in curve][:1] == [0] and curve[-1]["step"] == 2
    assert "ci95" in curve[-1]["gain_vs_base"]["overall"]
    assert (curve_out / "curve.png").is_file() and (curve_out / "before_after.png").is_file()
