"""A rollout's LoRA merged into the base weights: the same samples as the adapter branch in
float32, recomputed from the base copy after every update, and refused for DoRA."""

from __future__ import annotations

import pytest
import torch

from omnirl.models.base import WeightLoadError
from omnirl.models.sd3 import SD3RolloutAdapter
from omnirl.models.weights import full_state, lora_state
from omnirl.protocol.messages import PromptSpec, SamplingParams
from omnirl.rollout.model import resolve_lora_mode

pytestmark = pytest.mark.usefixtures("torch_one_thread")

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["to_q", "to_k", "to_v", "to_out.0"]}


def _load(path, lora=LORA, device="cpu"):
    return SD3RolloutAdapter.from_pretrained(path, device=device, lora=lora, max_sequence_length=16)


def _update(adapter, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        k: torch.randn(v.shape, generator=gen) * 0.1
        for k, v in lora_state(adapter.transformer).items()
    }


def _sample(adapter):
    sp = SamplingParams(group_size=2, num_steps=4, height=32, width=32, sde_window=(0, 3), seed=3)
    prompts = [PromptSpec(group_id="g", text="a photo of a cat")]
    return adapter.sample(prompts, sp, lease_id="l", worker_id="w", policy_version=0)[0]


def _layers(adapter):
    from peft.tuners.lora import LoraLayer

    return [m for m in adapter.transformer.modules() if isinstance(m, LoraLayer)]


def test_merged_lora_samples_what_the_adapter_samples(tiny_sd3_path):
    branch, merged = _load(tiny_sd3_path), _load(tiny_sd3_path)
    w0 = {id(m): m.get_base_layer().weight.detach().clone() for m in _layers(merged)}
    merged.merge_lora()
    assert all(m.merged for m in _layers(merged)) and not any(m.merged for m in _layers(branch))
    for seed in (1, 2):  # the second update replaces the first delta, not adds to it
        update = _update(branch, seed)
        branch.load_weights("lora", update)
        merged.load_weights("lora", update)
        a, b = _sample(branch), _sample(merged)
        rel = (a.next_latents - b.next_latents).norm() / a.next_latents.norm()
        assert rel < 1e-5, rel  # float32 rounding only
        assert torch.allclose(a.final_latents, b.final_latents, rtol=1e-4, atol=1e-5)
    for layer in _layers(merged):
        expected = w0[id(layer)] + layer.get_delta_weight("default")
        assert torch.allclose(layer.get_base_layer().weight, expected, atol=1e-7)
        assert not torch.equal(layer.get_base_layer().weight, w0[id(layer)])


def test_a_refused_update_leaves_the_merged_weights(tiny_sd3_path):
    merged = _load(tiny_sd3_path)
    merged.merge_lora()
    merged.load_weights("lora", _update(merged, 1))
    before = {id(m): m.get_base_layer().weight.clone() for m in _layers(merged)}
    bad = _update(merged, 2)
    bad[next(iter(bad))] = torch.full_like(bad[next(iter(bad))], float("nan"))
    with pytest.raises(WeightLoadError, match="NaN"):
        merged.load_weights("lora", bad)
    for layer in _layers(merged):
        assert torch.equal(layer.get_base_layer().weight, before[id(layer)])


def test_merge_created_by_the_first_update(tiny_sd3_path):
    """A worker whose adapter comes with the first update (adapter_config) merges it too."""
    adapter = SD3RolloutAdapter.from_pretrained(tiny_sd3_path, max_sequence_length=16)
    adapter.merge_lora()
    reference = _load(tiny_sd3_path)
    update = _update(reference, 1)
    adapter.load_weights("lora", update, adapter_config=dict(reference.lora_config))
    assert _layers(adapter) and all(m.merged for m in _layers(adapter))
    with pytest.raises(WeightLoadError, match="DoRA"):
        fresh = SD3RolloutAdapter.from_pretrained(tiny_sd3_path, max_sequence_length=16)
        fresh.merge_lora()
        fresh.load_weights("lora", update, adapter_config={**LORA, "use_dora": True})


def test_dora_is_never_merged(tiny_sd3_path):
    with pytest.raises(WeightLoadError, match="DoRA"):
        _load(tiny_sd3_path, {**LORA, "use_dora": True}).merge_lora()


def test_lora_mode_resolution():
    f32, bf16 = torch.float32, torch.bfloat16
    assert resolve_lora_mode("auto", LORA, f32) == "merged"
    assert resolve_lora_mode("auto", LORA, bf16) == "adapter"  # a merge would round it away
    assert resolve_lora_mode("auto", LORA, f32, float8=True) == "adapter"
    assert resolve_lora_mode("auto", {**LORA, "use_dora": True}, f32) == "adapter"
    assert resolve_lora_mode("merged", LORA, bf16) == "merged"  # asked for explicitly
    assert resolve_lora_mode("adapter", LORA, f32) == "adapter"
    assert resolve_lora_mode("auto", LORA, f32, can_merge=False) == "adapter"
    assert resolve_lora_mode("auto", None, f32) == "none"  # full weights
    with pytest.raises(ValueError, match="DoRA"):
        resolve_lora_mode("merged", {**LORA, "use_dora": True}, f32)
    with pytest.raises(ValueError, match="cannot be merged"):
        resolve_lora_mode("merged", LORA, f32, can_merge=False)
    with pytest.raises(ValueError, match="unknown LoRA mode"):
        resolve_lora_mode("fused", LORA, f32)


def test_rollout_cli_offers_exactly_the_modes():
    from omnirl.rollout.cli import build_parser
    from omnirl.rollout.model import LORA_MODES

    action = next(a for a in build_parser()._actions if a.dest == "lora_mode")
    assert tuple(action.choices) == LORA_MODES and action.default == "auto"


def _first_update(adapter_config):
    from omnirl.rollout.weights_inbox import ReadyUpdate

    return ReadyUpdate(
        version=1, format="lora", tensors={}, adapter_config=adapter_config, update_checksum=""
    )


def test_worker_model_merges_by_capability(tiny_sd3_path, make_welcome):
    from omnirl.models.registry import register_rollout_adapter
    from omnirl.rollout.model import RolloutModel

    first = _first_update(dict(LORA))
    sd3 = make_welcome(tiny_sd3_path, "StableDiffusion3Pipeline")
    built = RolloutModel.build(sd3, first, device="cpu", dtype="float32")
    assert built.adapter.merged_lora is not None  # auto, float32: merged
    built = RolloutModel.build(sd3, first, device="cpu", dtype="float32", lora_mode="adapter")
    assert built.adapter.merged_lora is None

    @register_rollout_adapter("NoMergeTestPipeline")
    class NoMerge:  # a family without the capability: auto keeps its branch
        @classmethod
        def from_pretrained(cls, path, *, device, dtype, lora):
            return cls()

    other = make_welcome(tiny_sd3_path, "NoMergeTestPipeline")
    assert isinstance(
        RolloutModel.build(other, first, device="cpu", dtype="float32").adapter, NoMerge
    )
    with pytest.raises(ValueError, match="cannot be merged"):
        RolloutModel.build(other, first, device="cpu", dtype="float32", lora_mode="merged")


def test_forced_merge_requantises_float8_base_layers(tiny_sd3_path, test_device):
    from omnirl.models.float8 import Float8Linear, quantize_rows

    adapter = _load(tiny_sd3_path, device=test_device)
    adapter.enable_float8()
    adapter.merge_lora()
    adapter.load_weights("lora", _update(adapter, 1))
    bases = [m.get_base_layer() for m in _layers(adapter)]
    assert bases and all(isinstance(b, Float8Linear) for b in bases)
    for base in bases:  # the float8 copy follows the merged weight
        assert torch.equal(base.weight_fp8.float(), quantize_rows(base.weight)[0].float())


def test_merged_lora_updates_keep_static_float8_scales(tiny_sd3_path, test_device):
    adapter = _load(tiny_sd3_path, device=test_device)
    adapter.enable_float8(activation="static")
    adapter.merge_lora()
    _sample(adapter)  # calibrates
    assert not adapter.float8_needs_calibration()
    adapter.load_weights("lora", _update(adapter, 2))  # merged: the base weights change
    assert not adapter.float8_needs_calibration()  # as an adapter's update would: scales kept
    adapter.load_weights("full", full_state(adapter.transformer))
    assert adapter.float8_needs_calibration()  # a full update recalibrates
