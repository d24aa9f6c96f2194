"""The workspace's console scripts start and explain themselves from a fresh environment."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent


@pytest.mark.parametrize(
    ("script", "needle"),
    [
        ("trainer", "--config"),
        ("rollout", "--trainer"),
        ("reward", "--scorer"),
        ("replay", "--speed"),
        ("omnirl", "launch"),
    ],
)
def test_console_script_help(script, needle):
    out = subprocess.run(
        [str(BIN / script), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr
    assert needle in out.stdout
