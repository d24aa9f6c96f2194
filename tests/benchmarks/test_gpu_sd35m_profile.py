"""``benchmarks/gpu_sd35m_profile.py``: kernels sorted into kinds by name."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        # names from the H100 / H200 profiles in benchmarks/results/
        ("nvjet_sm90_qqtst_128x128_128x6_1x1_h_bz_coopA_algo2_ovscale_TNT", "matmul"),
        ("sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc", "matmul"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26", "attention"),
        # inductor names a fused kernel after its ops, a matmul among them
        ("triton_red_fused__scaled_mm__to_copy_abs_add_amax_clamp_div_gelu_t_view_14", "triton"),
        ("triton_tem_fused_mm_0", "matmul"),
        ("void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl", "other"),
        # the CPU profile's operators
        ("aten::mm", "matmul"),
        ("aten::_scaled_mm", "matmul"),
        ("aten::addmm", "matmul"),
        ("aten::_scaled_dot_product_flash_attention_for_cpu_backward", "attention"),
        ("aten::copy_", "copy"),
        ("aten::mul", "other"),
    ],
)
def test_kernels_are_sorted_by_name(benchmark_script, name, kind):
    assert benchmark_script("gpu_sd35m_profile").kind_of(name) == kind


@pytest.mark.parametrize(
    ("name", "part"),
    [
        # names from the eighteenth session's H100 profile of the float8 step
        (
            "triton_red_fused__scaled_mm__to_copy_abs_add_amax_clamp_div_gelu_gelu_backward_t_5",
            "rowwise_quantize",
        ),
        (
            "triton_red_fused__to_copy_add_mul_native_layer_norm_native_layer_norm_backward_sp",
            "norm",
        ),
        ("triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0", "norm"),
        ("triton_poi_fused__scaled_mm__to_copy_add_clamp_clone_div_expand_gelu_t_view_17", "gelu"),
        ("triton_poi_fused__scaled_mm__to_copy_clamp_div_3", "static_quantize"),
        ("triton_poi_fused__to_copy__unsafe_view_add_cat_mul_transpose_view_8", "attention_layout"),
        ("triton_poi_fused__to_copy_add_mul_split_unsqueeze_view_18", "other"),
        # not inductor's element-wise kind: no part
        ("triton_tem_fused_mm_0", None),
        ("nvjet_sm90_qqtst_128x128_128x6_1x2_h_bz_ovscale_TNT", None),
    ],
)
def test_inductor_kernels_are_split_by_what_they_fuse(benchmark_script, name, part):
    assert benchmark_script("gpu_sd35m_profile").triton_part_of(name) == part


def test_the_summary_adds_each_part_and_kind(benchmark_script):
    """Kernel times as the H100 profile of the float8 step reported them (ms, calls)."""
    summary = benchmark_script("gpu_sd35m_profile").summarize_kernels(
        [
            (1_286_720.0, "nvjet_sm90_qqtst_128x128_128x6_1x2_h_bz_ovscale_TNT", 9009),
            (134_100.0, "triton_red_fused__scaled_mm__to_copy_abs_add_amax_clamp_div_gelu_5", 207),
            (59_690.0, "triton_red_fused__scaled_mm__to_copy_abs_add_amax_expand_mul_pow_t", 216),
            (60_930.0, "triton_red_fused__to_copy_add_mul_native_layer_norm_backward_split", 108),
            (37_150.0, "triton_poi_fused__to_copy_add_mul_split_unsqueeze_view_18", 234),
            (0.0, "triton_poi_fused_never_ran_0", 1),  # no time: left out
        ],
        top=2,
    )
    assert summary["triton_parts_ms"] == {"norm": 60.93, "other": 37.15, "rowwise_quantize": 193.79}
    assert summary["triton_ms"] == 291.87 and summary["matmul_ms"] == 1286.72
    assert summary["total_ms"] == 1578.59 and summary["launches"] == 9009 + 207 + 216 + 108 + 234
    assert summary["top"][0].startswith("1286.72 ms x9009 nvjet") and len(summary["top"]) == 2


def test_the_profiler_is_summarised_on_the_cpu(benchmark_script, torch_one_thread):
    import torch

    profile = benchmark_script("gpu_sd35m_profile")
    x = torch.randn(64, 64)
    row = profile.profile_kernels(torch.device("cpu"), lambda: (x @ x).relu().sum())
    assert row["total_ms"] > 0 and row["matmul_ms"] > 0 and row["launches"] >= 3
