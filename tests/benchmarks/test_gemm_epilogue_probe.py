"""``benchmarks/gemm_epilogue_probe.py`` on toy shapes (the CPU's emulated float8 matmul):
every case's variants timed and checked against eager, the best compiled one compared with
``default``, results written as they come."""

from __future__ import annotations

import json

import pytest


@pytest.fixture
def probe(benchmark_script):
    return benchmark_script("gemm_epilogue_probe")


def test_every_case_is_timed_against_eager(probe, tmp_path, torch_one_thread):
    args = ["--tiny", "--device", "cpu", "--seconds", "0", "--out", str(tmp_path)]
    rows = probe.main([*args, "--variants", "eager,default,autotune"])
    cases = [r for r in rows if r["stage"] == "case"]
    assert [(r["case"], r["variant"]) for r in cases] == [
        (name, v) for name in probe.TINY_CASES for v in ("eager", "default", "autotune")
    ]
    for row in cases:
        assert row["ms"] > 0, row
        # the same maths compiled: at most one float8 rounding step apart (e4m3 values < 8
        # here are spaced 1/8 to 1 apart) or bf16 rounding of the gated sum
        assert row["max_abs_diff"] <= 1.0, row
    compiled = [r for r in cases if r["variant"] != "eager"]
    assert all(r["compile_s"] >= 0 and r["cublas"] for r in compiled)  # the CPU has no templates
    best = {r["case"]: r for r in rows if r["stage"] == "best"}
    assert set(best) == set(probe.TINY_CASES)
    assert all(b["variant"] == "autotune" and b["speedup"] > 0 for b in best.values())
    lines = (tmp_path / "gemm_epilogue_probe.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["stage"] == "env" and len(lines) == 1 + len(rows)


def test_the_budget_skips_what_no_longer_fits(probe, torch_one_thread):
    rows = probe.main(["--tiny", "--device", "cpu", "--seconds", "0", "--budget-s", "0"])
    assert rows and all(r.get("skipped") == "budget" for r in rows)


def test_an_unknown_case_is_refused_by_name(probe):
    with pytest.raises(SystemExit):
        probe.main(["--tiny", "--cases", "ff_up_gelu_quant,nonesuch"])


def test_the_kernel_listing_tells_cublas_from_a_fused_template(probe):
    code = (
        "triton_tem_fused__scaled_mm_add_gelu_0 = async_compile.triton('t', '''...\n"
        "triton_poi_fused_add_1 = async_compile.triton('p', '''...\n"
    )
    info = probe.kernels_of(code)
    assert info["template"] == ["triton_tem_fused__scaled_mm_add_gelu_0"]
    assert info["kernels"] == ["triton_tem_fused__scaled_mm_add_gelu_0", "triton_poi_fused_add_1"]
    assert not info["cublas"]
    assert probe.kernels_of("buf0 = extern_kernels._scaled_mm(a, b)")["cublas"]
