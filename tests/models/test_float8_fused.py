"""Sibling float8 projections fused into one matmul (``omnirl.models.float8_fused``): the
same outputs, LoRA branches and gradients as the layers called one by one; the groups it
cannot fuse run unfused; SD3's fused joint-attention processor computes diffusers' attention
and compiles. Device-aware (``OMNIRL_TEST_DEVICE=cuda``)."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, inject_adapter_in_model
from torch import nn

from omnirl.models import float8_fused
from omnirl.models.float8 import Float8Linear, float8_layers
from omnirl.models.float8_fused import fusable_bases, project_fused
from omnirl.models.float8_static import float8_calibration

pytestmark = pytest.mark.usefixtures("torch_one_thread")
NAMES = ("q", "k", "v")


class Siblings(nn.Module):
    """Three projections of one input, as an attention's q, k and v."""

    def __init__(self, dim=64, out=(64, 64, 32)):
        super().__init__()
        for name, n in zip(NAMES, out, strict=True):
            setattr(self, name, nn.Linear(dim, n))

    def layers(self):
        return [getattr(self, n) for n in NAMES]


def _siblings(device, *, lora: bool, activation="rowwise", input_grad=None, seed=0):
    torch.manual_seed(seed)
    module = Siblings().to(device, torch.bfloat16).requires_grad_(False)
    for name in NAMES:
        layer = Float8Linear(getattr(module, name), activation=activation)
        if input_grad:
            layer.enable_backward(input_grad)
        setattr(module, name, layer)
    if lora:
        config = LoraConfig(r=4, lora_alpha=8, target_modules=list(NAMES), init_lora_weights=False)
        inject_adapter_in_model(config, module)
    return module


def _calibrate(module, x):
    with torch.no_grad(), float8_calibration(module):
        for layer in module.layers():
            layer(x)


def _count_fused(monkeypatch):
    calls = []
    real = float8_fused.fused_base_outputs
    monkeypatch.setattr(
        float8_fused, "fused_base_outputs", lambda b, x: calls.append(len(b)) or real(b, x)
    )
    return calls


@pytest.mark.parametrize("activation", ["rowwise", "static"])
@pytest.mark.parametrize("lora", [False, True], ids=["plain", "lora"])
def test_fused_outputs_are_the_layers_outputs(test_device, monkeypatch, activation, lora):
    module = _siblings(test_device, lora=lora, activation=activation)
    x = torch.randn(2, 24, 64, device=test_device, dtype=torch.bfloat16)
    if activation == "static":
        _calibrate(module, x)
    calls = _count_fused(monkeypatch)
    with torch.no_grad():
        fused = project_fused(module.layers(), x)
        separate = [layer(x) for layer in module.layers()]
    assert calls == [3]
    for got, want in zip(fused, separate, strict=True):
        assert got.shape == want.shape and got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("input_grad", ["float8", "model_dtype"])
def test_fused_gradients_are_the_layers_gradients(test_device, monkeypatch, input_grad):
    grads = {}
    for fused in (False, True):
        module = _siblings(test_device, lora=True, activation="static", input_grad=input_grad)
        torch.manual_seed(1)
        x0 = torch.randn(2, 24, 64, device=test_device, dtype=torch.bfloat16)
        _calibrate(module, x0)
        x = x0.clone().requires_grad_()
        calls = _count_fused(monkeypatch)
        outs = project_fused(module.layers(), x) if fused else [m(x) for m in module.layers()]
        assert calls == ([3] if fused else [])
        loss = sum((o.float() * (i + 1)).square().mean() for i, o in enumerate(outs))
        loss.backward()
        lora = [p.grad for n, p in module.named_parameters() if "lora_" in n]
        assert len(lora) == 6 and all(g is not None for g in lora)
        grads[fused] = (x.grad, lora)
    (dx, lora), (dx_fused, lora_fused) = grads[False], grads[True]
    # the same terms, summed in another order in bf16 (members' input gradients and LoRA's)
    # (both are 0.4 % (model dtype) and 1.1 % (float8) from the float64 input gradient here)
    assert ((dx_fused - dx).float().norm() / dx.float().norm()) < 1e-2
    for got, want in zip(lora_fused, lora, strict=True):
        torch.testing.assert_close(got, want)


def test_groups_it_cannot_fuse_run_layer_by_layer(test_device, monkeypatch):
    module = _siblings(test_device, lora=True, activation="static")
    x = torch.randn(2, 8, 64, device=test_device, dtype=torch.bfloat16)
    layers = module.layers()
    assert fusable_bases(layers) is None  # not calibrated yet
    _calibrate(module, x)
    assert fusable_bases(layers) is not None
    base_v = float8_layers(module)[2]
    for change, undo in (
        (lambda: setattr(base_v, "active", False), lambda: setattr(base_v, "active", True)),
        (
            lambda: base_v.configure(activation="rowwise", fast_accum=False),
            lambda: (
                base_v.configure(activation="static", fast_accum=False),
                _calibrate(module, x),
            ),
        ),
        (
            lambda: setattr(base_v, "calibrating", True),
            lambda: setattr(base_v, "calibrating", False),
        ),
    ):
        change()
        assert fusable_bases(layers) is None
        calls = _count_fused(monkeypatch)
        with torch.no_grad():
            got = project_fused(layers, x)
            want = [layer(x) for layer in layers]
        assert calls == []
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w)
        undo()
    assert fusable_bases(layers) is not None
    assert fusable_bases([nn.Linear(4, 4), nn.Linear(4, 4)]) is None


def test_disabled_adapters_give_the_base_outputs(test_device, monkeypatch):
    module = _siblings(test_device, lora=True)
    x = torch.randn(2, 8, 64, device=test_device, dtype=torch.bfloat16)
    layers = module.layers()
    for layer in layers:
        layer.enable_adapters(False)
    calls = _count_fused(monkeypatch)
    with torch.no_grad():
        got = project_fused(layers, x)
    assert calls == [3]
    for g, layer in zip(got, layers, strict=True):
        assert torch.equal(g, layer.get_base_layer()(x))


# ------------------------------------------------------------------ SD3's joint attention


def _sd3_blocks(device):
    """An SD3.5-style tiny transformer (dual attention in layer 0, q/k RMSNorm, a
    context-pre-only last layer) with float8 block layers and a LoRA adapter on every
    attention projection."""
    from omnirl.models.compile import repeated_blocks
    from omnirl.models.float8 import convert_to_float8
    from omnirl.models.sd3.lora import add_lora
    from omnirl.models.sd3.tiny import TinySD3Config, _transformer

    torch.manual_seed(0)
    cfg = TinySD3Config(sample_size=8, dual_attention_layers=(0,), qk_norm="rms_norm")
    model = _transformer(cfg).to(device, torch.bfloat16)
    add_lora(model, {"r": 4, "lora_alpha": 8})
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    convert_to_float8(repeated_blocks(model))
    for layer in float8_layers(model):
        layer.enable_backward("float8")
    return model


def _sd3_inputs(device):
    """Inputs of the tiny config: 16 latent channels, 8x8, 6 text tokens of width 32."""
    gen = torch.Generator().manual_seed(3)
    rand = lambda *s: torch.randn(*s, generator=gen).to(device, torch.bfloat16)  # noqa: E731
    return {
        "hidden_states": rand(2, 16, 8, 8),
        "encoder_hidden_states": rand(2, 6, 32),
        "pooled_projections": rand(2, 32),
        "timestep": torch.tensor([500.0, 250.0], device=device),
    }


def _run(model, inputs):
    """The model's output under autocast (its LoRA matrices are float32, as the adapters'),
    ``[B, C, H, W]``."""
    with torch.autocast(inputs["hidden_states"].device.type, dtype=torch.bfloat16):
        return model(**inputs).sample


def test_sd3_fused_processor_computes_diffusers_attention_and_compiles(test_device, monkeypatch):
    from omnirl.models.compile import CompileConfig, compile_module
    from omnirl.models.sd3.fused_attention import (
        FusedProjectionsJointAttnProcessor,
        fuse_projections,
    )

    model = _sd3_blocks(test_device)
    inputs = _sd3_inputs(test_device)
    with torch.no_grad():
        want = _run(model, inputs)
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    _run(model, inputs).float().square().mean().backward()
    want_grads = [p.grad.clone() for p in lora]
    model.zero_grad()

    # two blocks: sample and context streams in each, plus layer 0's image-only attention
    assert fuse_projections(model) == 3 and fuse_projections(model) == 3
    assert fuse_projections(model, fuse=False) == 0  # diffusers' processor back
    assert {type(m.processor).__name__ for m in model.modules() if hasattr(m, "processor")} == {
        "JointAttnProcessor2_0"
    }
    assert fuse_projections(model) == 3
    processors = {type(m.processor) for m in model.modules() if hasattr(m, "processor")}
    assert processors == {FusedProjectionsJointAttnProcessor}
    calls = _count_fused(monkeypatch)
    with torch.no_grad():
        got = _run(model, inputs)
    assert calls == [3, 3, 3, 3, 3]  # layer 0: sample, context, image-only; layer 1: both
    torch.testing.assert_close(got, want, rtol=0, atol=0)

    _run(model, inputs).float().square().mean().backward()
    # the same up to bf16 input gradients summed in another order (then float8-quantised)
    got_all = torch.cat([p.grad.flatten() for p in lora])
    want_all = torch.cat([w.flatten() for w in want_grads])
    assert (got_all - want_all).norm() / want_all.norm() < 5e-3
    for p, w in zip(lora, want_grads, strict=True):
        if not w.any():  # (the last layer's text-stream output projection feeds nothing)
            assert not p.grad.any()
        else:
            assert nn.functional.cosine_similarity(p.grad.flatten(), w.flatten(), 0) > 0.999
    model.zero_grad()

    backend = "aot_eager" if test_device == "cpu" else "inductor"
    compile_module(model, CompileConfig(backend=backend, fullgraph=True))
    with torch.no_grad():
        compiled = _run(model, inputs)
    torch.testing.assert_close(compiled, want, rtol=2e-2, atol=2e-2)
    _run(model, inputs).float().square().mean().backward()
    compiled_all = torch.cat([p.grad.flatten() for p in lora])
    assert (compiled_all - want_all).norm() / want_all.norm() < 5e-2
