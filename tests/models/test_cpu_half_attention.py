"""A half-precision model's call on a CPU runs its attention in float32 (model_autocast)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from omnirl.models.device import Float32Attention, model_autocast


def _qkv(dtype):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(2, 4, 80, 24, generator=gen).to(dtype).requires_grad_() for _ in range(3)]


def test_bf16_attention_on_a_cpu_runs_in_float32_and_returns_bf16():
    q32, k32, v32 = _qkv(torch.float32)
    expected = F.scaled_dot_product_attention(q32, k32, v32)
    q, k, v = (t.detach().to(torch.bfloat16).requires_grad_() for t in (q32, k32, v32))
    with model_autocast("cpu", torch.bfloat16):
        out = F.scaled_dot_product_attention(q, k, v)
        plain_linear = torch.nn.functional.linear(q32, torch.eye(24))  # other calls: autocast's
    assert out.dtype == torch.bfloat16 and plain_linear.dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16_kernel = F.scaled_dot_product_attention(q, k, v)
    with torch.no_grad():
        in_float32 = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    assert torch.equal(out, in_float32.to(torch.bfloat16))
    assert not torch.equal(out, bf16_kernel)  # the check can tell the two kernels apart
    assert (out.float() - expected).abs().mean() < (bf16_kernel.float() - expected).abs().mean()
    out.float().square().sum().backward()
    assert q.grad is not None and q.grad.dtype == torch.bfloat16 and q.grad.isfinite().all()


def test_float32_models_and_float32_inputs_are_left_alone():
    q, k, v = _qkv(torch.float32)
    with Float32Attention():
        a = F.scaled_dot_product_attention(q, k, v)
    assert torch.equal(a, F.scaled_dot_product_attention(q, k, v))
    with model_autocast("cpu", torch.float32):  # a no-op context
        assert not torch.is_autocast_enabled("cpu")
