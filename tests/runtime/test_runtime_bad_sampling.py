"""Sampling parameters the model refuses end the run with a clear error, not a hang.

Real processes on loopback (``omnirl launch``: trainer, one rollout worker, one reward
worker) with a height the tiny SD3 cannot sample (not a multiple of its VAE factor times its
patch). The trainer checks the run's sampling parameters against the model's rules before it
issues a lease (``DiffusionTrainingAdapter.check_sampling``) and stops with exit code 2
naming the problem. (A worker that refuses a lease anyway gives it back marked
``bad_sampling`` and the trainer stops the same way: ``tests/trainer/test_lease_return.py``.)
Before either, every lease failed, the worker was benched again and again, and the run never
ended.
"""

from __future__ import annotations

import subprocess
import time

import pytest
from procs import BIN, ENV, EXAMPLE, overrides

pytestmark = pytest.mark.slow


@pytest.mark.timeout(240)
def test_a_size_the_model_refuses_ends_the_run_with_exit_code_2(tiny_sd3_path, tmp_path):
    out = tmp_path / "run"
    argv = [
        str(BIN / "omnirl"), "launch", str(EXAMPLE),
        *overrides(tiny_sd3_path, out, max_steps=1000, sampling__height=34),
        "--rollout", "1", "--reward", "1", "--rollout-args=--threads 1",
    ]  # fmt: skip
    start = time.monotonic()
    proc = subprocess.run(
        argv, capture_output=True, text=True, env=ENV, timeout=200, start_new_session=True
    )
    elapsed = time.monotonic() - start
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text[-3000:]
    assert "the model refuses this run's sampling parameters" in text
    assert "multiples of 4, got 34x32" in text and "change the run's sampling settings" in text
    # refused before any lease: no worker sampled anything
    assert "leases_issued" not in (out / "logs" / "trainer.log").read_text()
    assert elapsed < 120, elapsed
