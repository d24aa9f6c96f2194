"""Float8 training of frozen linear layers (``train.float8``): the forward and the input
gradient as float8 matmuls, no weight gradient, nothing of the input saved; an SD3 LoRA
trainer with them stays close to the model-dtype trainer in log-probs and gradients, and
compiles. Device-aware (``OMNIRL_TEST_DEVICE=cuda``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from omnirl.models.compile import CompileConfig
from omnirl.models.float8 import Float8Error, Float8Linear, float8_layers, quantize_rows
from omnirl.models.sd3 import SD3RolloutAdapter, SD3TrainingAdapter
from omnirl.models.transitions import collate_transitions
from omnirl.models.weights import lora_state
from omnirl.protocol.messages import PromptSpec, SamplingParams

pytestmark = pytest.mark.usefixtures("torch_one_thread")
LORA = {"r": 4, "lora_alpha": 8}


def _frozen_layer(device, in_features=128, out_features=64):
    torch.manual_seed(0)
    linear = nn.Linear(in_features, out_features).to(device, torch.bfloat16)
    linear.requires_grad_(False)
    return linear


def test_input_gradient_is_the_float8_matmul_and_close_to_the_linear(test_device):
    linear = _frozen_layer(test_device)
    reference = _frozen_layer(test_device)
    layer = Float8Linear(linear)
    layer.enable_backward()
    assert layer.trains and layer.weight_t_fp8.shape == (128, 64)
    x = torch.randn(3, 40, 128, device=test_device, dtype=torch.bfloat16, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    grad = torch.randn(3, 40, 64, device=test_device, dtype=torch.bfloat16)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = layer(x)
    y.backward(grad)
    reference(x_ref).backward(grad)
    # the input gradient is exactly dy (per-row e4m3) @ W (per-input-channel e4m3)
    q_dy, s_dy = quantize_rows(grad.reshape(-1, 64))
    # [in, out] contiguous, so that its transpose is column-major (cuBLASLt's b)
    q_w, s_w = quantize_rows(linear.weight.t().contiguous())
    expected = torch._scaled_mm(
        q_dy, q_w.t(), scale_a=s_dy, scale_b=s_w.t(), out_dtype=torch.bfloat16
    ).reshape(3, 40, 128)
    assert torch.equal(x.grad, expected)
    cos = nn.functional.cosine_similarity(x.grad.float().flatten(), x_ref.grad.float().flatten(), 0)
    assert cos > 0.99
    assert linear.weight.grad is None  # frozen: no weight gradient
    # only the weight's float8 copy and its scales are kept for the backward, nothing of x
    assert saved and all(t.numel() <= 128 * 64 for t in saved)
    assert not any(t.shape[:1] == (120,) for t in saved)


def test_training_through_a_layer_needs_enable_backward_and_a_frozen_weight(test_device):
    layer = Float8Linear(_frozen_layer(test_device))
    x = torch.randn(4, 128, device=test_device, dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(Float8Error, match="needs enable_backward"):
        layer(x)
    with torch.no_grad():  # inference through it is fine (the reference pass)
        assert layer(x).shape == (4, 64)
    trained = Float8Linear(nn.Linear(128, 64).to(test_device, torch.bfloat16))
    trained.weight.requires_grad_(True)  # frozen by the conversion; unfrozen by hand
    with pytest.raises(Float8Error, match="trains only with a frozen weight"):
        trained.enable_backward()
    static = Float8Linear(_frozen_layer(test_device), activation="static")
    with pytest.raises(Float8Error, match="row-wise scales, not 'static'"):
        static.enable_backward()


def test_refresh_requantises_the_input_gradient_copy(test_device):
    linear = _frozen_layer(test_device)
    layer = Float8Linear(linear)
    layer.enable_backward()
    before = layer.weight_t_scale.clone()
    with torch.no_grad():
        linear.weight.mul_(2)
    layer.refresh()
    torch.testing.assert_close(layer.weight_t_scale, before * 2)


@pytest.fixture(scope="module")
def groups(tiny_sd3_path, test_device):
    torch.manual_seed(0)
    rollout = SD3RolloutAdapter.from_pretrained(
        tiny_sd3_path, device=test_device, lora=LORA, max_sequence_length=16
    )
    sampling = SamplingParams(group_size=2, num_steps=3, height=32, width=32, sde_window=(0, 2))
    prompts = [PromptSpec(group_id="g", text="a cat")]
    return rollout.sample(prompts, sampling, lease_id="l", worker_id="w", policy_version=0)


def _trainer(path, device, *, float8: bool, compiled: bool = False):
    torch.manual_seed(0)
    train = SD3TrainingAdapter.from_pretrained(path, device=device, dtype=torch.bfloat16, lora=LORA)
    with torch.no_grad():
        for p in train.trainable_parameters():
            p.add_(0.01)  # a non-zero B, so that gradients reach every LoRA matrix
    if float8:
        assert train.enable_float8() > 0
    if compiled:
        train.compile(CompileConfig(backend="aot_eager"))
    return train


def test_sd3_lora_trainer_in_float8_stays_close_and_compiles(tiny_sd3_path, test_device, groups):
    batch = collate_transitions(groups, 1)
    results = {}
    for name, kwargs in {
        "bf16": {"float8": False},
        "float8": {"float8": True},
        "float8 compiled": {"float8": True, "compiled": True},
    }.items():
        train = _trainer(tiny_sd3_path, test_device, **kwargs)
        out = train.transition(batch, sde_type="sde")
        out.log_prob.sum().backward()
        grads = torch.cat([p.grad.flatten() for p in train.trainable_parameters()]).float().cpu()
        with torch.no_grad(), train.reference():  # the adapter-disabled pass, in float8 too
            ref = train.transition(batch, sde_type="sde").log_prob.cpu()
        results[name] = (
            out.log_prob.detach().cpu(),
            grads,
            ref,
            set(lora_state(train.transformer)),
        )
        if kwargs["float8"]:
            layers = float8_layers(train.transformer)
            assert layers and all(layer.trains for layer in layers)
            names = [n for n, m in train.transformer.named_modules() if isinstance(m, Float8Linear)]
            assert not any("lora_" in n for n in names)  # the LoRA branches stay bf16
    logp, grads, ref, keys = results["bf16"]
    for name in ("float8", "float8 compiled"):
        logp8, grads8, ref8, keys8 = results[name]
        assert keys8 == keys  # float8 renames no exported LoRA tensor
        assert 0 < (logp8 - logp).abs().max() < 0.05, name  # a different matmul, still close
        assert (ref8 - ref).abs().max() < 0.05, name
        cos = nn.functional.cosine_similarity(grads8, grads, 0)
        assert cos > 0.98, (name, cos)
    torch.testing.assert_close(results["float8 compiled"][0], results["float8"][0])
    torch.testing.assert_close(results["float8 compiled"][1], results["float8"][1])


def test_float8_training_is_refused_for_a_full_fine_tune(tiny_sd3_path, test_device):
    train = SD3TrainingAdapter.from_pretrained(tiny_sd3_path, device=test_device)
    with pytest.raises(Float8Error, match="needs a LoRA run"):
        train.enable_float8()
