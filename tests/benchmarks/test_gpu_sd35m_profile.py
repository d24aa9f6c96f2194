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
