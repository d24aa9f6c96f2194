"""The trainer as two ``torchrun`` ranks (gloo, CPU) behind ``omnirl launch --trainer-procs 2``,
with real rollout and reward workers: both replicas end equal to the weights the rollout
worker applied last, and a resumed run brings the follower rank along."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "tiny_sd3_jpeg.yaml"
pytestmark = pytest.mark.slow


def _launch(out: Path, *extra: str) -> str:
    cmd = [
        sys.executable, "-m", "omnirl.tools.cli", "launch", str(CONFIG),
        f"run.output_dir={out}", "runtime.control_port=0", *extra,
        "--trainer-procs", "2", "--rollout", "1", "--reward", "1",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    return proc.stdout


def _digests(text: str) -> tuple[str, str, str, int]:
    """(rank 0's, rank 1's, the rollout's last applied) digest, and rank 1's step count."""
    (rank0,) = re.findall(r"rank 0 of 2: replica digest (\w+)", text)
    ((steps, rank1),) = re.findall(r"rank 1 of 2: (\d+) steps; replica digest (\w+)", text)
    applied = re.findall(r"applied weights version=\d+ format=lora digest=(\w+)", text)
    return rank0, rank1, applied[-1], int(steps)


def test_two_trainer_ranks_stay_replicas_of_what_the_workers_run(tmp_path):
    out = tmp_path / "run"
    text = _launch(out, "max_steps=3")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward_mean" in r] == [1, 2, 3]
    rank0, rank1, applied, steps = _digests(text)
    assert steps == 3
    assert rank0 == rank1 == applied

    text = _launch(out, "max_steps=5", "--resume")
    assert "resumed from" in text
    rank0, rank1, applied, steps = _digests(text)
    assert steps == 2  # the follower loaded the checkpoint, then trained steps 4 and 5
    assert rank0 == rank1 == applied
