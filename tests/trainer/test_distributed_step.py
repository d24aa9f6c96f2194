"""Data-parallel TrainStep: two gloo processes (FSDP2, then gradient all-reduce) train the
tiny SD3 exactly as one process does, up to float32 rounding (``benchmarks/fsdp_step.py``)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "fsdp_step.py"
pytestmark = pytest.mark.slow


def _run(launcher: list[str], out: Path, tiny_sd3_path, *args: str) -> dict:
    cmd = [*launcher, str(SCRIPT), "--model", str(tiny_sd3_path), "--out", str(out), *args]
    env = {"OMP_NUM_THREADS": "1", "PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def single(tiny_sd3_path, tmp_path_factory):
    return _run([sys.executable], tmp_path_factory.mktemp("one") / "one.pt", tiny_sd3_path)


@pytest.mark.parametrize("mode", ["fsdp", "ddp"])
def test_two_ranks_train_like_one(tiny_sd3_path, tmp_path, single, mode):
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    assert torchrun is not None
    launcher = [torchrun, "--standalone", "--nproc-per-node", "2"]
    two = _run(launcher, tmp_path / "two.pt", tiny_sd3_path, "--mode", mode)
    assert two["summary"]["mode"] == mode and two["summary"]["world_size"] == 2
    one_s, two_s = single["summary"], two["summary"]
    assert two_s["losses"] == pytest.approx(one_s["losses"], rel=1e-4, abs=1e-7)
    assert two_s["grad_norms"] == pytest.approx(one_s["grad_norms"], rel=1e-4)
    assert two_s["parity_max"][0] < 1e-5  # on-policy at the first step
    for name, value in single["weights"].items():
        torch.testing.assert_close(two["weights"][name], value, atol=1e-5, rtol=1e-4)
