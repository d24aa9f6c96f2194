"""``add_lora(cast_inputs=False)``: the same values and gradients as PEFT's input cast, in bf16."""

from __future__ import annotations

import pytest
import torch

from omnirl.models.sd3.lora import add_lora
from omnirl.models.sd3.step import SD3Conditioning, guided_velocity

pytestmark = pytest.mark.usefixtures("torch_one_thread")


def _model(cast_inputs: bool, test_device):
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    model = SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=2,
        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
        caption_projection_dim=32, pooled_projection_dim=16, pos_embed_max_size=8,
        qk_norm="rms_norm", dual_attention_layers=(0,),
    )  # fmt: skip
    add_lora(model, {"r": 4, "lora_alpha": 8}, cast_inputs=cast_inputs)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # move the adapter off its no-op init (B = 0)
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return model.to(device=test_device, dtype=torch.bfloat16)


def _lora_layers(model):
    from peft.tuners.lora import LoraLayer

    return [m for m in model.modules() if isinstance(m, LoraLayer)]


def test_cast_switch_is_set_on_every_adapted_layer(test_device):
    assert all(not m.cast_input_dtype_enabled for m in _lora_layers(_model(False, test_device)))
    assert all(m.cast_input_dtype_enabled for m in _lora_layers(_model(True, test_device)))


def test_no_input_cast_gives_identical_bf16_outputs_and_gradients(test_device):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 4, 8, 8, generator=gen).to(test_device)
    t = torch.tensor([500.0, 250.0], device=test_device)
    cond = SD3Conditioning(
        prompt_embeds=torch.randn(2, 6, 32, generator=gen).to(test_device),
        pooled_prompt_embeds=torch.randn(2, 16, generator=gen).to(test_device),
        negative_prompt_embeds=torch.randn(2, 6, 32, generator=gen).to(test_device),
        negative_pooled_prompt_embeds=torch.randn(2, 16, generator=gen).to(test_device),
    )
    results = []
    for cast_inputs in (True, False):
        model = _model(cast_inputs, test_device)
        for name, p in model.named_parameters():  # master copies stay float32 (as add_lora)
            if "lora_" in name:
                p.data = p.data.float()
        v = guided_velocity(model, x, t, cond, 4.5, model_dtype=torch.bfloat16)
        v.square().mean().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((v.detach(), grads))
    (v_cast, g_cast), (v_fast, g_fast) = results
    assert v_cast.dtype == torch.float32
    assert torch.equal(v_cast, v_fast)
    assert g_cast.keys() == g_fast.keys() and len(g_cast) > 0
    for name in g_cast:
        assert torch.equal(g_cast[name], g_fast[name]), name
