"""Float8 linear layers of the rollout: quantisation error, which layers convert, and an SD3
rollout that samples with them, takes LoRA and full-weight updates, and stays close to the
model-dtype rollout's log-probs. Device-aware (``OMNIRL_TEST_DEVICE=cuda``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from omnirl.models.float8 import (
    FLOAT8_MAX,
    Float8Error,
    Float8Linear,
    check_float8_device,
    convert_to_float8,
    quantize_rows,
)
from omnirl.models.float8_static import (
    float8_calibration,
    needs_float8_calibration,
    request_float8_calibration,
)
from omnirl.models.sd3 import SD3RolloutAdapter
from omnirl.models.weights import full_state, lora_state
from omnirl.protocol.messages import PromptSpec, SamplingParams

pytestmark = pytest.mark.usefixtures("torch_one_thread")


def test_row_quantisation_error_is_within_e4m3_precision():
    torch.manual_seed(0)
    x = torch.randn(64, 96) * torch.logspace(-3, 3, 64).unsqueeze(1)  # rows of any magnitude
    q, scale = quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (64, 1)
    back = q.float() * scale
    # 3 mantissa bits: relative error <= 2^-4 for every element that scales to a normal
    # e4m3 value (>= 2^-6)
    normal = x.abs() * FLOAT8_MAX / x.abs().amax(1, keepdim=True) >= 2**-6
    rel = ((back - x).abs() / x.abs())[normal]
    assert rel.max() <= 2**-4 + 1e-6
    assert torch.equal(q.float().abs().amax(1), torch.full((64,), FLOAT8_MAX))
    zeros, _ = quantize_rows(torch.zeros(2, 16))  # an all-zero row stays zero, no NaN
    assert torch.equal(zeros.float(), torch.zeros(2, 16))


def test_float8_linear_matches_the_linear_it_replaces(test_device):
    torch.manual_seed(0)
    linear = nn.Linear(128, 64).to(test_device, torch.bfloat16)
    x = torch.randn(3, 50, 128, device=test_device, dtype=torch.bfloat16)
    expected = linear(x).float()
    fp8 = Float8Linear(linear)
    assert fp8.weight is linear.weight and fp8.bias is linear.bias  # the same parameters
    with torch.no_grad():  # the rollout's mode
        got = fp8(x)
    assert got.dtype == torch.bfloat16 and got.shape == (3, 50, 64)
    err = (got.float() - expected).norm() / expected.norm()
    assert 0 < err < 0.06  # e4m3 on both operands: a few percent, not bit-equal
    with torch.no_grad():
        linear.weight.mul_(2)
        fp8.refresh()  # re-quantised from the changed parameter, in place
        err2 = (fp8(x).float() - linear(x).float()).norm() / linear(x).float().norm()
    assert err2 < 0.06
    # the weight is frozen; one set to want a gradient again is refused (float8 gives none)
    assert not fp8.weight.requires_grad
    fp8.weight.requires_grad_(True)
    with pytest.raises(Float8Error, match="frozen weight"):
        fp8(x)


def test_conversion_leaves_modulation_lora_and_odd_sizes_alone():
    from peft import LoraConfig, inject_adapter_in_model

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1 = nn.Module()
            self.norm1.linear = nn.Linear(32, 96)  # adaLN modulation
            self.attn = nn.Module()
            self.attn.to_q = nn.Linear(32, 32)
            self.attn.to_out = nn.ModuleList([nn.Linear(32, 32)])
            self.odd = nn.Linear(32, 10)

    block = Block()
    inject_adapter_in_model(LoraConfig(r=4, target_modules=["to_q"]), block)
    keys = set(block.state_dict())
    assert convert_to_float8([block]) == 2
    assert type(block.attn.to_q.base_layer) is Float8Linear  # PEFT's base layer converted
    assert type(block.attn.to_q.lora_A["default"]) is nn.Linear  # the adapter is not
    assert type(block.attn.to_out[0]) is Float8Linear
    assert type(block.norm1.linear) is nn.Linear and type(block.odd) is nn.Linear
    assert set(block.state_dict()) == keys  # fp8 copies are not state
    assert convert_to_float8([block]) == 0  # idempotent


def test_device_check_names_the_problem(test_device):
    if test_device == "cpu":  # the float8 tests run on the CPU's emulation: it must be there
        check_float8_device("cpu")
    else:  # a GPU image's torch may refuse it (2.11 does): then the error names the release
        try:
            check_float8_device("cpu")
        except Float8Error as err:
            assert "cannot run row-wise float8 matmuls on the CPU" in str(err)
            assert torch.__version__ in str(err)
    with pytest.raises(Float8Error, match="CUDA GPU or the CPU"):
        check_float8_device("meta")


STEPS = 4  # a behaviour log-prob depends only on its noise; the means are compared


def _sample(adapter, group_size=3):
    sp = SamplingParams(
        group_size=group_size, num_steps=STEPS, height=32, width=32, sde_window=(0, 3), seed=7
    )
    prompts = [PromptSpec(group_id=n, text=f"a photo of {n}") for n in ("cat", "dog")]
    return adapter.sample(prompts, sp, lease_id="l", worker_id="w", policy_version=0)


def test_sd3_rollout_in_float8_samples_close_to_the_model_dtype(tiny_sd3_path, test_device):
    lora = {"r": 4, "lora_alpha": 4, "target_modules": ["to_q", "to_k", "to_v"]}
    load = lambda: SD3RolloutAdapter.from_pretrained(  # noqa: E731
        tiny_sd3_path, device=test_device, dtype=torch.bfloat16, lora=lora, max_sequence_length=16
    )
    plain, fp8 = load(), load()
    count = fp8.enable_float8()
    layers = [m for m in fp8.transformer.modules() if isinstance(m, Float8Linear)]
    assert count == len(layers) > 0
    # the tiny model's LoRA update with a non-zero B: applies on top of the float8 base
    torch.manual_seed(1)
    update = {
        k: torch.randn_like(v, dtype=torch.float32) * 0.05
        for k, v in lora_state(plain.transformer).items()
    }
    for a in (plain, fp8):
        a.load_weights("lora", update)
    ref, got = _sample(plain), _sample(fp8)
    for r, g in zip(ref, got, strict=True):
        assert torch.isfinite(g.log_probs).all() and g.log_probs.dtype == torch.float32
        assert torch.equal(g.latents[:, 0], r.latents[:, 0])  # same seeds, same x_T
        # the same step noise on a mean moved by the float8 matmuls: close, not equal
        rel = (g.next_latents - r.next_latents).norm() / r.next_latents.norm()
        assert 0 < rel < 0.05, rel

    # a full update re-quantises the float8 copies from the new parameters
    before = layers[0].weight_fp8.float().clone()
    state = full_state(fp8.transformer)
    state = {k: v * 1.5 if v.is_floating_point() else v for k, v in state.items()}
    fp8.load_weights("full", state)
    assert not torch.equal(layers[0].weight_fp8.float(), before)
    q, _ = quantize_rows(layers[0].weight)
    assert torch.equal(layers[0].weight_fp8.float(), q.float())


# ---------------------------------------------------------------------- static activation scales


def _static_pair(test_device):
    torch.manual_seed(0)
    linear = nn.Linear(128, 64).to(test_device, torch.bfloat16)
    rowwise = Float8Linear(linear)
    static = Float8Linear(linear, activation="static")
    return linear, rowwise, static


def test_static_layer_calibrates_on_the_calls_inside_the_block(test_device):
    linear, rowwise, static = _static_pair(test_device)
    module = nn.Sequential(static)
    x = torch.randn(3, 50, 128, device=test_device, dtype=torch.bfloat16)
    big = x * 4
    assert needs_float8_calibration(module)
    # uncalibrated: it quantises row-wise, exactly as the default layer does
    assert torch.equal(static(x), rowwise(x))
    with float8_calibration(module, margin=2.0):
        during = module(x)
        module(big)  # the amax is the largest over every call
    assert torch.equal(during, rowwise(x))  # calibrating calls are row-wise too
    assert not needs_float8_calibration(module)
    expected = 2.0 * big.abs().amax().float() / FLOAT8_MAX
    torch.testing.assert_close(static.input_scale.view(()), expected)
    ref = linear(x).float()
    got = static(x)
    assert not torch.equal(got, rowwise(x))  # now one scale for every row
    err = (got.float() - ref).norm() / ref.norm()
    assert 0 < err < 0.06, err


def test_static_layer_saturates_beyond_its_range_instead_of_overflowing(test_device):
    linear, _, static = _static_pair(test_device)
    x = torch.randn(4, 128, device=test_device, dtype=torch.bfloat16)
    with float8_calibration(nn.Sequential(static), margin=1.0):
        static(x)
    out = static(x * 1000)  # 1000x the calibrated range: clamped at +-448 x scale
    assert torch.isfinite(out).all()
    clamped = (
        (x * 1000)
        .float()
        .clamp(-float(static.input_scale) * FLOAT8_MAX, float(static.input_scale) * FLOAT8_MAX)
    )
    ref = torch.nn.functional.linear(clamped, linear.weight.float(), linear.bias.float())
    assert ((out.float() - ref).norm() / ref.norm()) < 0.06


def test_static_scales_and_fast_accumulation_compile(test_device):
    linear, _, static = _static_pair(test_device)
    static.configure(activation="static", fast_accum=True)
    module = nn.Sequential(static)
    x = torch.randn(2, 20, 128, device=test_device, dtype=torch.bfloat16)
    compiled = torch.compile(module, backend="aot_eager" if test_device == "cpu" else "inductor")
    with float8_calibration(module):
        compiled(x)  # runs eagerly: no graph of the calibrating forward
    eager = module(x).float()
    got = compiled(x).float()
    torch.testing.assert_close(got, eager, rtol=2e-2, atol=2e-2)
    ref = linear(x).float()
    assert (got - ref).norm() / ref.norm() < 0.06


def test_float8_options_name_the_problem():
    linear = nn.Linear(32, 32)
    with pytest.raises(Float8Error, match="unknown float8 activation scaling 'tensorwise'"):
        Float8Linear(linear, activation="tensorwise")
    calibration = float8_calibration(nn.Sequential(Float8Linear(linear)), margin=0.5)
    with pytest.raises(Float8Error, match="margin must be >= 1"), calibration:
        pass


def test_failed_calibration_fixes_no_scale(test_device):
    linear = nn.Linear(32, 32).to(test_device, torch.bfloat16)
    layer = Float8Linear(linear, activation="static")
    with pytest.raises(RuntimeError, match="boom"), float8_calibration(nn.Sequential(layer)):
        layer(torch.randn(2, 32, device=test_device, dtype=torch.bfloat16))
        raise RuntimeError("boom")
    assert layer.needs_calibration and not layer.calibrating


def test_a_layer_calibration_never_reaches_falls_back_to_row_wise(test_device):
    torch.manual_seed(0)
    make = lambda: Float8Linear(  # noqa: E731
        nn.Linear(32, 32).to(test_device, torch.bfloat16), activation="static"
    )
    used, unused = make(), make()
    module = nn.ModuleList([used, unused])
    with float8_calibration(module):
        used(torch.randn(4, 32, device=test_device, dtype=torch.bfloat16))
    assert not needs_float8_calibration(module)  # no eager calibration on every later call
    assert used.activation == "static" and unused.activation == "rowwise"
    x = torch.randn(4, 32, device=test_device, dtype=torch.bfloat16) * 100
    assert torch.isfinite(unused(x)).all()


def test_sd3_rollout_with_static_float8_calibrates_once_and_after_full_updates(
    tiny_sd3_path, test_device
):
    load = lambda: SD3RolloutAdapter.from_pretrained(  # noqa: E731
        tiny_sd3_path, device=test_device, dtype=torch.bfloat16, max_sequence_length=16
    )
    plain, fp8 = load(), load()
    count = fp8.enable_float8(activation="static", fast_accum=True)
    layers = [m for m in fp8.transformer.modules() if isinstance(m, Float8Linear)]
    assert count == len(layers) > 0
    assert all(m.activation == "static" and m.fast_accum for m in layers)
    assert fp8.float8_needs_calibration()
    ref = _sample(plain)
    first = _sample(fp8)  # calibrates (row-wise meanwhile)
    assert not fp8.float8_needs_calibration()
    scales = [float(m.input_scale) for m in layers]
    assert all(s > 0 for s in scales)
    second = _sample(fp8)  # static scales
    for r, a, b in zip(ref, first, second, strict=True):
        for got in (a, b):
            assert torch.isfinite(got.log_probs).all()
            rel = (got.next_latents - r.next_latents).norm() / r.next_latents.norm()
            assert 0 < rel < 0.05, rel
        assert not torch.equal(a.next_latents, b.next_latents)  # really another scaling
    # a full update moves every activation: the next call recalibrates
    state = {
        k: v * 1.5 if v.is_floating_point() else v for k, v in full_state(fp8.transformer).items()
    }
    fp8.load_weights("full", state)
    assert fp8.float8_needs_calibration()
    _sample(fp8)
    assert not fp8.float8_needs_calibration()
    assert [float(m.input_scale) for m in layers] != scales
    # enabling again re-configures the converted layers
    assert fp8.enable_float8() == count
    assert all(m.activation == "rowwise" and not m.fast_accum for m in layers)
    assert not fp8.float8_needs_calibration()


def test_recalibration_reports_how_far_the_inputs_grew(test_device, caplog):
    linear, _, static = _static_pair(test_device)
    module = nn.Sequential(static)
    x = torch.randn(4, 128, device=test_device, dtype=torch.bfloat16)
    assert request_float8_calibration(module) == 1 and needs_float8_calibration(module)
    with float8_calibration(module, margin=2.0):
        static(x)
    first = float(static.input_scale)
    assert static.calibrated_amax == pytest.approx(float(x.abs().amax()))
    assert request_float8_calibration(module) == 1  # asked again: the next call calibrates
    assert needs_float8_calibration(module)
    with caplog.at_level("INFO", logger="omnirl.models.float8"), float8_calibration(module):
        static(x * 4)  # the inputs grew 4x (exactly, in bf16), beyond the margin of 2
    assert float(static.input_scale) == pytest.approx(4 * first)
    assert "grew up to 4.00x" in caplog.text and "1 layers beyond the margin" in caplog.text
    assert request_float8_calibration(nn.Sequential(Float8Linear(linear))) == 0  # row-wise


def test_rollout_model_recalibrates_static_scales_every_n_lora_updates(tiny_sd3_path, test_device):
    from omnirl.rollout.model import RolloutModel
    from omnirl.rollout.weights_inbox import ReadyUpdate

    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["to_q", "to_k", "to_v", "to_out.0"]}
    adapter = SD3RolloutAdapter.from_pretrained(
        tiny_sd3_path, device=test_device, lora=lora, max_sequence_length=16
    )
    adapter.enable_float8(activation="static")
    model = RolloutModel(adapter, format="lora", float8_recalibrate_every=2)
    _sample(adapter)  # calibrates
    gen = torch.Generator().manual_seed(0)

    def update(version):
        tensors = {
            k: torch.randn(v.shape, generator=gen) * 0.1
            for k, v in lora_state(adapter.transformer).items()
        }
        return ReadyUpdate(version, "lora", tensors, dict(lora), "")

    model.apply(update(1))
    assert not adapter.float8_needs_calibration()
    model.apply(update(2))  # the second LoRA update since the calibration
    assert adapter.float8_needs_calibration()
    _sample(adapter)
    assert not adapter.float8_needs_calibration()
    model.apply(update(3))
    assert not adapter.float8_needs_calibration()  # the count starts again
    with pytest.raises(ValueError, match="float8_recalibrate_every must be >= 0"):
        RolloutModel(adapter, format="lora", float8_recalibrate_every=-1)


def test_compiled_warm_up_leaves_the_static_scales_to_the_first_real_lease(
    tiny_sd3_path, test_device, make_welcome
):
    """The warm-up lease's stand-in prompt is not what the run samples: its calibration
    compiles the static graph and is then dropped, so the first real lease calibrates."""
    from omnirl.rollout.model import RolloutModel

    adapter = SD3RolloutAdapter.from_pretrained(
        tiny_sd3_path, device=test_device, max_sequence_length=16
    )
    adapter.enable_float8(activation="static")
    welcome = make_welcome(
        tiny_sd3_path,
        "StableDiffusion3Pipeline",
        {"sampling": {"num_steps": STEPS, "height": 32, "width": 32}},
    )
    RolloutModel(adapter, format="full").compile_and_warm_up(welcome, backend="aot_eager")
    assert adapter.backend == "compiled" and adapter.float8_needs_calibration()
    layers = [m for m in adapter.transformer.modules() if isinstance(m, Float8Linear)]
    warm_up = [m.calibrated_amax for m in layers]
    _sample(adapter)  # the first real lease: calibrates on its prompts
    assert not adapter.float8_needs_calibration()
    assert [m.calibrated_amax for m in layers] != warm_up


def test_rollout_with_fused_projections_samples_what_the_layers_sample(tiny_sd3_path, test_device):
    """``enable_float8(fuse_projections=True)``: after a LoRA update, the same trajectories
    (calibration, sampling and the adapter branches go through the fused processor)."""
    from omnirl.models.sd3.fused_attention import FusedProjectionsJointAttnProcessor
    from omnirl.rollout.model import RolloutModel
    from omnirl.rollout.weights_inbox import ReadyUpdate

    lora = {"r": 4, "lora_alpha": 8}
    gen = torch.Generator().manual_seed(0)
    tensors = None
    trajectories = {}
    for fuse in (False, True):
        adapter = SD3RolloutAdapter.from_pretrained(
            tiny_sd3_path, device=test_device, lora=lora, max_sequence_length=16
        )
        adapter.enable_float8(activation="static", fast_accum=True, fuse_projections=fuse)
        processors = {
            type(m.processor) for m in adapter.transformer.modules() if hasattr(m, "processor")
        }
        assert (FusedProjectionsJointAttnProcessor in processors) == fuse
        if tensors is None:
            tensors = {
                k: torch.randn(v.shape, generator=gen) * 0.1
                for k, v in lora_state(adapter.transformer).items()
            }
        RolloutModel(adapter, format="lora").apply(ReadyUpdate(1, "lora", tensors, dict(lora), ""))
        _sample(adapter)  # calibrates
        trajectories[fuse] = _sample(adapter)
    for plain, fused in zip(trajectories[False], trajectories[True], strict=True):
        assert torch.equal(plain.log_probs, fused.log_probs)
        assert torch.equal(plain.final_latents, fused.final_latents)


@pytest.mark.parametrize("flag", ["--float8-fast-accum", "--float8-fuse-projections"])
def test_rollout_refuses_float8_options_without_float8(flag, capsys):
    from omnirl.rollout.cli import main

    assert main(["--trainer", "tcp://127.0.0.1:1", flag]) == 2
    assert f"{flag} needs --float8" in capsys.readouterr().err
