"""``benchmarks/norm_quant_probe.py`` on toy shapes: every variant timed at every shape, the
hand-written Triton kernel (in Triton's CPU interpreter) computing the block's norm and
modulation as torch does."""

from __future__ import annotations

import json

import pytest


@pytest.fixture
def probe(benchmark_script, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # read when the kernel is first built
    return benchmark_script("norm_quant_probe")


def test_every_variant_is_timed_and_the_kernel_is_compared(probe, tmp_path, torch_one_thread):
    rows = probe.main(
        ["--tiny", "--device", "cpu", "--seconds", "0", "--outputs", "y+3q", "--out", str(tmp_path)]
    )
    kernels = [(r["variant"], r["rows"]) for r in rows if r["stage"] == "kernel"]
    assert kernels == [
        (v, m) for m, _ in probe.TINY_SHAPES for v in ("bandwidth", "inductor", "triton")
    ]
    assert all(r["ms"] > 0 and r["outputs"] == "y+3q" for r in rows if r["stage"] == "kernel")
    compared = [r for r in rows if r["stage"] == "triton_vs_inductor"]
    assert [r["rows"] for r in compared] == [m for m, _ in probe.TINY_SHAPES]
    for r in compared:
        assert r["y_max_diff"] <= 0.0625  # a bf16 step at the outputs' size (up to ~8)
    lines = (tmp_path / "norm_quant_probe.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["stage"] == "env" and len(lines) == 1 + len(rows)


def test_the_kernel_is_the_reference(probe, torch_one_thread):
    """``y`` within a bf16 step; ``q`` within one e4m3 step of the reference wherever the
    interpreter's float8 conversion rounds within the value's binade (it truncates a carry
    into the next one: 126.9 -> 64 where the GPU gives 128), which most values do."""
    import torch

    inputs = probe.make_inputs(40, 10, 48, 3, "cpu")
    got = probe.norm_modulate_quantize(**inputs, tokens=10, write_y=True)
    want = probe.reference(**inputs, tokens=10, write_y=True)
    assert (got[0].float() - want[0].float()).abs().max() <= 0.0625
    assert len(got[1]) == 3
    for q, ref in zip(got[1], want[1], strict=True):
        assert q.dtype == torch.float8_e4m3fn and q.shape == (40, 48)
        assert (q.float() == ref.float()).float().mean() > 0.9
