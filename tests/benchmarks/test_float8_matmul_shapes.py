"""``benchmarks/float8_matmul_shapes.py`` on toy shapes (the CPU's emulated float8 matmul):
every shape timed, the fused and padded comparisons built from the timed rows."""

from __future__ import annotations

import json

import pytest


@pytest.fixture
def probe(benchmark_script):
    return benchmark_script("float8_matmul_shapes")


def test_every_shape_is_timed_and_compared(probe, tmp_path, torch_one_thread):
    rows = probe.main(["--tiny", "--device", "cpu", "--seconds", "0", "--out", str(tmp_path)])
    timed = [(r["rows"], r["in"], r["out"]) for r in rows if r["stage"] == "matmul"]
    assert timed == [(m, k, n) for m in (256, 80) for k, n in probe.TINY_SHAPES]
    assert all(r["ms"] > 0 for r in rows if r["stage"] == "matmul")
    fused = {r["rows"]: r for r in rows if r["stage"] == "qkv_fused"}
    assert set(fused) == {256, 80}
    square = next(
        r["ms"] for r in rows if (r.get("rows"), r.get("in"), r.get("out")) == (80, 32, 32)
    )
    assert fused[80]["separate_ms"] == round(3 * square, 4)
    fused_grad = {r["rows"]: r for r in rows if r["stage"] == "qkv_fused_input_grad"}
    assert set(fused_grad) == {256, 80}
    wide_in = next(
        r["ms"] for r in rows if (r.get("rows"), r.get("in"), r.get("out")) == (80, 96, 32)
    )
    assert fused_grad[80]["fused_ms"] == wide_in and fused_grad[80]["separate_ms"] == round(
        3 * square, 4
    )
    padded = [r for r in rows if r["stage"] == "padded"]
    assert [(r["rows"], r["padded_rows"]) for r in padded] == [(80, 256)] * len(probe.TINY_SHAPES)
    lines = (tmp_path / "float8_matmul_shapes.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["stage"] == "env" and len(lines) == 1 + len(rows)


def test_comparisons_pair_only_timed_shapes(probe):
    rows = [
        {"stage": "matmul", "rows": 100, "in": 4, "out": 4, "ms": 1.0},
        {"stage": "matmul", "rows": 100, "in": 4, "out": 12, "ms": 2.0},
        {"stage": "matmul", "rows": 256, "in": 4, "out": 4, "ms": 0.5},
    ]
    out = probe.comparisons(rows, ((4, 4), (4, 12)), [100, 256])
    assert out == [
        {"stage": "qkv_fused", "rows": 100, "separate_ms": 3.0, "fused_ms": 2.0, "speedup": 1.5},
        {
            "stage": "padded",
            "rows": 100,
            "padded_rows": 256,
            "in": 4,
            "out": 4,
            "ms": 1.0,
            "padded_ms": 0.5,
            "speedup": 2.0,
        },
    ]
