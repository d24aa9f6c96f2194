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


def _digests(text: str) -> tuple[str, str, dict[int, str], int]:
    """(rank 0's, rank 1's digest, the rollout's applied digest by version, rank 1's steps)."""
    (rank0,) = re.findall(r"rank 0 of 2: replica digest (\w+)", text)
    ((steps, rank1),) = re.findall(r"rank 1 of 2: (\d+) steps; replica digest (\w+)", text)
    applied = re.findall(r"applied weights version=(\d+) format=lora digest=(\w+)", text)
    return rank0, rank1, {int(v): d for v, d in applied}, int(steps)


def _check_replicas(text: str, *, final_version: int, steps: int) -> None:
    rank0, rank1, applied, follower_steps = _digests(text)
    assert follower_steps == steps
    assert rank0 == rank1  # the follower is a replica of rank 0
    # what the worker ran is what the trainer holds: the final version's digest, when the
    # worker fetched it before the run ended (after max_steps the trainer answers for
    # shutdown_grace_s only, so on a loaded machine the worker can stop one version short:
    # then its last version must be the one before)
    if final_version in applied:
        assert applied[final_version] == rank0
    else:
        assert max(applied) == final_version - 1, sorted(applied)


def test_two_trainer_ranks_stay_replicas_of_what_the_workers_run(tmp_path):
    out = tmp_path / "run"
    text = _launch(out, "max_steps=3")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward_mean" in r] == [1, 2, 3]
    _check_replicas(text, final_version=3, steps=3)

    text = _launch(out, "max_steps=5", "--resume")
    assert "resumed from" in text
    # the follower loaded the checkpoint, then trained steps 4 and 5
    _check_replicas(text, final_version=5, steps=2)
