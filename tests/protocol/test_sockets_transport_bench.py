"""The transport benchmark runs end to end (tiny message) and finds no copies on decode."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_transport_benchmark_smoke():
    cmd = [sys.executable, str(ROOT / "benchmarks/transport.py"), "--size-mb", "1"]
    cmd += ["--runs", "2", "--warmup", "0", "--transports", "tcp"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "| tcp | raw pyzmq multipart, copy=False |" in out.stdout
    assert "| tcp | omnirl encode+send / recv+decode |" in out.stdout
    assert "tcp: 0 of 10." in out.stdout
