"""``CompileConfig.activation_memory_budget``: a compiled block's backward keeps fewer
activations and recomputes the rest, with the same gradients.

Traced with ``aot_eager`` (AOTAutograd's partitioner, which reads the budget, without
generating kernels) on the tiny SD3 trainer with LoRA."""

from __future__ import annotations

import pytest
import torch

from omnirl.models.compile import CompileConfig
from omnirl.models.sd3 import SD3TrainingAdapter

pytestmark = pytest.mark.usefixtures("torch_one_thread")


def _saved_bytes_and_grads(path, device, budget):
    """Bytes autograd saves for one compiled forward of the tiny transformer, and the
    LoRA gradients of a loss on its output."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    adapter = SD3TrainingAdapter.from_pretrained(
        path, device=device, lora={"r": 4, "lora_alpha": 8}
    )
    adapter.compile(CompileConfig(backend="aot_eager", activation_memory_budget=budget))
    model = adapter.transformer
    cfg = model.config
    gen = torch.Generator().manual_seed(1)
    side = cfg.sample_size

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    inputs = {
        "hidden_states": rand(2, cfg.in_channels, side, side),
        "encoder_hidden_states": rand(2, 8, cfg.joint_attention_dim),
        "pooled_projections": rand(2, cfg.pooled_projection_dim),
        "timestep": torch.tensor([500.0, 250.0], device=device),
    }
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(**inputs, return_dict=False)[0]
    out.float().square().mean().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    assert grads, "no LoRA parameter received a gradient"
    return sum(saved), grads


def test_a_small_budget_saves_less_and_gives_the_same_gradients(tiny_sd3_path, test_device):
    full_bytes, full_grads = _saved_bytes_and_grads(tiny_sd3_path, test_device, None)
    small_bytes, small_grads = _saved_bytes_and_grads(tiny_sd3_path, test_device, 0.05)
    assert small_bytes < 0.75 * full_bytes, (small_bytes, full_bytes)
    assert full_grads.keys() == small_grads.keys()
    for name, grad in full_grads.items():
        torch.testing.assert_close(small_grads[name], grad, atol=1e-6, rtol=1e-5, msg=name)


def test_a_budget_outside_zero_to_one_is_refused():
    with pytest.raises(ValueError, match=r"activation_memory_budget must be in \(0, 1\]"):
        CompileConfig(activation_memory_budget=0.0)
    with pytest.raises(ValueError, match=r"not 1\.5"):
        CompileConfig(activation_memory_budget=1.5)
