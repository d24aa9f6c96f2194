"""``benchmarks/norm_quant_probe.py`` on toy shapes, in a fresh process with Triton's CPU
interpreter (it must be on before anything imports Triton): every variant timed at every
shape; the hand-written kernel computes the block's norm and modulation as torch does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "norm_quant_probe.py"
TINY_ROWS = (96, 40)  # the script's TINY_SHAPES


def test_every_variant_is_timed_and_the_kernel_is_the_reference(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(SCRIPT), "--tiny", "--device", "cpu", "--seconds", "0"]
    cmd += ["--outputs", "y+3q,1q", "--out", str(tmp_path)]
    subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=600)
    lines = (tmp_path / "norm_quant_probe.jsonl").read_text().splitlines()
    env_row, *rows = (json.loads(line) for line in lines)
    assert env_row["stage"] == "env" and env_row["device"] == "cpu"
    kernels = [(r["variant"], r["rows"], r["outputs"]) for r in rows if r["stage"] == "kernel"]
    assert kernels == [
        (v, m, o)
        for m in TINY_ROWS
        for o in ("y+3q", "1q")
        for v in ("bandwidth", "inductor", "triton")
    ]
    assert all(r["ms"] > 0 for r in rows if r["stage"] == "kernel")
    compared = [r for r in rows if r["stage"] == "triton_vs_inductor"]
    assert [(r["rows"], r["outputs"]) for r in compared] == [
        (m, o) for m in TINY_ROWS for o in ("y+3q", "1q")
    ]
    for r in compared:
        # y within a bf16 step at the outputs' size (up to ~8); float8 values equal but for
        # the interpreter's truncated carries (the script's docstring)
        assert (r["y_max_diff"] is None) == (r["outputs"] == "1q")
        assert r["y_max_diff"] is None or r["y_max_diff"] <= 0.0625
        assert r["q_equal_share"] > 0.9
