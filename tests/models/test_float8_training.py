"""Float8 training of frozen linear layers (``train.float8``): the forward (row-wise or
static scales) and the input gradient (float8 or the model dtype) as the layer says, no
weight gradient, nothing of the input saved; an SD3 LoRA trainer with them stays close to
the model-dtype trainer in log-probs and gradients, and compiles; a trainer whose float8
covers only the reference pass computes the policy exactly as the model dtype does; a
TrainStep calibrates static scales before any log-prob of the step and again every so many
updates. Device-aware (``OMNIRL_TEST_DEVICE=cuda``)."""

from __future__ import annotations

import msgspec
import pytest
import torch
from torch import nn

from omnirl.models.compile import CompileConfig
from omnirl.models.float8 import (
    Float8Error,
    Float8Linear,
    Float8Training,
    float8_layers,
    quantize_rows,
    quantize_static,
    scaled_matmul,
)
from omnirl.models.float8_static import float8_calibration
from omnirl.models.sd3 import SD3RolloutAdapter, SD3TrainingAdapter
from omnirl.models.transitions import collate_transitions
from omnirl.models.weights import lora_state
from omnirl.protocol.messages import PromptSpec, Rewards, SamplingParams
from omnirl.trainer.step import TrainStep

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
    with pytest.raises(Float8Error, match="unknown float8 input gradient 'fp16'"):
        layer.enable_backward("fp16")


def test_static_forward_with_a_model_dtype_input_gradient(test_device):
    linear = _frozen_layer(test_device)
    layer = Float8Linear(linear, activation="static")
    layer.enable_backward("model_dtype")
    assert layer.trains and layer.weight_t_fp8 is None  # no second float8 copy
    x = torch.randn(3, 40, 128, device=test_device, dtype=torch.bfloat16, requires_grad=True)
    with torch.no_grad(), float8_calibration(layer):
        layer(x)
    assert not layer.needs_calibration
    grad = torch.randn(3, 40, 64, device=test_device, dtype=torch.bfloat16)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = layer(x)
    y.backward(grad)
    # the forward quantises at the calibrated scale, the same numbers as the no-grad pass
    q, scale = quantize_static(x.detach().reshape(-1, 128), layer.input_scale)
    expected = scaled_matmul(q, layer.weight_fp8.t(), scale, layer.weight_scale, False)
    expected = (expected + linear.bias).reshape(3, 40, 64)
    torch.testing.assert_close(y, expected, rtol=0, atol=0)
    with torch.no_grad():
        assert torch.equal(layer(x), y)
    # the input gradient is the model dtype's dy @ W, exactly
    assert torch.equal(x.grad, (grad.reshape(-1, 64) @ linear.weight).reshape(3, 40, 128))
    assert [tuple(t.shape) for t in saved] == [(64, 128)]  # the bf16 weight, nothing of x


def test_a_switched_off_layer_is_the_plain_linear(test_device):
    linear = _frozen_layer(test_device)
    layer = Float8Linear(linear)
    layer.enable_backward()
    x = torch.randn(5, 128, device=test_device, dtype=torch.bfloat16)
    assert not torch.equal(layer(x), linear(x))
    layer.active = False
    assert torch.equal(layer(x), nn.functional.linear(x, linear.weight, linear.bias))
    assert "off (model dtype)" in repr(layer)


def test_float8_training_options_name_a_bad_value():
    with pytest.raises(Float8Error, match="unknown float8 scope 'policy'"):
        Float8Training(scope="policy")
    with pytest.raises(Float8Error, match="unknown float8 activation scaling 'tensor'"):
        Float8Training(activation="tensor")
    with pytest.raises(Float8Error, match="margin must be >= 1"):
        Float8Training(margin=0.5)


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


def _trainer(path, device, *, float8: Float8Training | None, compiled: bool = False):
    torch.manual_seed(0)
    train = SD3TrainingAdapter.from_pretrained(path, device=device, dtype=torch.bfloat16, lora=LORA)
    with torch.no_grad():
        for p in train.trainable_parameters():
            p.add_(0.01)  # a non-zero B, so that gradients reach every LoRA matrix
    if float8 is not None:
        assert train.enable_float8(float8) > 0
    if compiled:
        train.compile(CompileConfig(backend="aot_eager"))
    return train


STATIC = Float8Training(activation="static", input_grad="model_dtype", fast_accum=True)


@pytest.mark.parametrize("options", [Float8Training(), STATIC], ids=["rowwise", "static"])
def test_sd3_lora_trainer_in_float8_stays_close_and_compiles(
    tiny_sd3_path, test_device, groups, options
):
    batch = collate_transitions(groups, 1)
    results = {}
    for name, kwargs in {
        "bf16": {"float8": None},
        "float8": {"float8": options},
        "float8 compiled": {"float8": options, "compiled": True},
    }.items():
        train = _trainer(tiny_sd3_path, test_device, **kwargs)
        assert train.float8_needs_calibration() == (kwargs["float8"] is STATIC)
        if train.float8_needs_calibration():
            with torch.no_grad(), train.float8_calibration():
                train.transition(batch, sde_type="sde")
                with train.reference():
                    train.transition(batch, sde_type="sde")
            assert not train.float8_needs_calibration()
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


def test_float8_for_the_reference_pass_alone_leaves_the_policy_in_the_model_dtype(
    tiny_sd3_path, test_device, groups
):
    batch = collate_transitions(groups, 1)
    results = {}
    for name, options in {"bf16": None, "reference": Float8Training(scope="reference")}.items():
        train = _trainer(tiny_sd3_path, test_device, float8=options)
        out = train.transition(batch, sde_type="sde")
        out.log_prob.sum().backward()
        grads = torch.cat([p.grad.flatten() for p in train.trainable_parameters()])
        with torch.no_grad(), train.reference():
            ref = train.transition(batch, sde_type="sde").log_prob
        results[name] = (out.log_prob.detach(), grads, ref)
        if options is not None:  # off again after the reference pass
            assert not any(layer.active for layer in float8_layers(train.transformer))
    (logp, grads, ref), (logp8, grads8, ref8) = results["bf16"], results["reference"]
    assert torch.equal(logp8, logp) and torch.equal(grads8, grads)
    assert 0 < (ref8 - ref).abs().max() < 0.05  # the reference pass ran in float8


def _rewarded(groups):
    return [
        msgspec.structs.replace(g, rewards=Rewards(group_id=g.group_id, total=[0.0, 1.0]))
        for g in groups
    ]


def test_train_step_calibrates_static_scales_before_its_log_probs(
    tiny_sd3_path, test_device, groups
):
    options = Float8Training(activation="static", input_grad="model_dtype", recalibrate_every=2)
    train = _trainer(tiny_sd3_path, test_device, float8=options)
    layers = float8_layers(train.transformer)
    # lr scaled to 0: the policy never moves, so every ratio is 1 exactly if the proximal
    # pass and the updates quantise alike, which they do only if the scales were fixed first
    config = TrainStep.Config(kl_beta=0.01, num_minibatches=2, micro_batch_size=1)
    step = TrainStep(train, "flow_grpo", config)
    m = step.step(_rewarded(groups), policy_version=0, lr_scale=0.0)
    assert m["optimizer_steps"] == 2 and m["ratio_std"] == 0.0 and m["approx_kl"] == 0.0
    static = [layer for layer in layers if layer.activation == "static"]  # the reached ones
    assert len(static) > len(layers) // 2
    assert all(layer.calibrated_amax is not None for layer in static)
    assert all(float(layer.input_scale) != 1.0 for layer in static)
    # the second update asked for a new calibration (recalibrate_every=2), done by the next step
    assert train.float8_needs_calibration()
    scales = [layer.input_scale.clone() for layer in static]
    for layer in static:
        layer.input_scale.fill_(1.0)
    step.step(_rewarded(groups), policy_version=0, lr_scale=0.0)
    assert all(torch.equal(layer.input_scale, s) for layer, s in zip(static, scales, strict=True))


def test_float8_training_is_refused_for_a_full_fine_tune(tiny_sd3_path, test_device):
    train = SD3TrainingAdapter.from_pretrained(tiny_sd3_path, device=test_device)
    with pytest.raises(Float8Error, match="needs a LoRA run"):
        train.enable_float8()


def test_static_scales_survive_a_checkpoint(tiny_sd3_path, test_device, groups, tmp_path):
    from omnirl.trainer.checkpoint import load_checkpoint, save_checkpoint

    options = Float8Training(activation="static", input_grad="model_dtype")
    config = TrainStep.Config(kl_beta=0.01, micro_batch_size=1)
    train = _trainer(tiny_sd3_path, test_device, float8=options)
    step = TrainStep(train, "flow_grpo", config)
    step.step(_rewarded(groups), policy_version=0)
    path = save_checkpoint(tmp_path, 1, state={}, adapter=train, train_step=step)

    resumed = _trainer(tiny_sd3_path, test_device, float8=options)
    resumed_step = TrainStep(resumed, "flow_grpo", config)
    load_checkpoint(path, adapter=resumed, train_step=resumed_step)
    assert not resumed.float8_needs_calibration()  # no calibration pass on resume
    pairs = zip(float8_layers(train.transformer), float8_layers(resumed.transformer), strict=True)
    layers = list(pairs)
    assert any(a.activation == "static" for a, _ in layers)
    for a, b in layers:
        assert a.activation == b.activation and a.calibrated_amax == b.calibrated_amax
        assert torch.equal(a.input_scale, b.input_scale)
    # the next update is the uninterrupted run's
    m, m_resumed = (s.step(_rewarded(groups), policy_version=1) for s in (step, resumed_step))
    for key in ("loss", "grad_norm"):  # approx: a GPU's backward may reduce in another order
        assert m_resumed[key] == pytest.approx(m[key], rel=1e-6, abs=1e-12), key

    # a row-wise run resumed from it keeps its own scaling
    rowwise = _trainer(tiny_sd3_path, test_device, float8=Float8Training())
    load_checkpoint(path, adapter=rowwise, train_step=TrainStep(rowwise, "flow_grpo", config))
    assert all(layer.activation == "rowwise" for layer in float8_layers(rowwise.transformer))


def test_a_reference_scope_trainer_calibrates_on_the_reference_pass_alone(
    tiny_sd3_path, test_device, groups
):
    """Its layers run only in the reference pass, so only that pass calibrates them: one
    model call per batch (a policy pass too would be two), and the scales are the ones a
    calibration inside the reference pass alone gives."""
    options = Float8Training(activation="static", scope="reference")
    batches = [collate_transitions(groups, 1)]
    train = _trainer(tiny_sd3_path, test_device, float8=options)
    calls = []
    hook = train.transformer.register_forward_hook(lambda *_: calls.append(1))
    train.calibrate_float8(batches, sde_type="sde", reference=True)
    hook.remove()
    assert len(calls) == 1 and not train.float8_needs_calibration()
    scales = [float(layer.input_scale) for layer in float8_layers(train.transformer)]
    alone = _trainer(tiny_sd3_path, test_device, float8=options)
    with torch.no_grad(), alone.float8_calibration(), alone.reference():
        alone.transition(batches[0], sde_type="sde")
    assert scales == [float(layer.input_scale) for layer in float8_layers(alone.transformer)]


def test_fused_projections_train_as_the_layers_do(tiny_sd3_path, test_device, groups):
    """``Float8Training.fuse_projections``: the same log-probs (forward and reference pass)
    and, up to bf16 summation order, the same LoRA gradients; compiled too."""
    from omnirl.models.sd3.fused_attention import FusedProjectionsJointAttnProcessor

    batch = collate_transitions(groups, 1)
    results = {}
    for fuse, compiled in ((False, False), (True, False), (True, True)):
        options = Float8Training(activation="static", fast_accum=True, fuse_projections=fuse)
        train = _trainer(tiny_sd3_path, test_device, float8=options, compiled=compiled)
        fused = [
            m
            for m in train.transformer.modules()
            if isinstance(getattr(m, "processor", None), FusedProjectionsJointAttnProcessor)
        ]
        assert len(fused) == (2 if fuse else 0)  # every block's joint attention
        with torch.no_grad(), train.float8_calibration():
            train.transition(batch, sde_type="sde")
        out = train.transition(batch, sde_type="sde")
        out.log_prob.sum().backward()
        grads = torch.cat([p.grad.flatten() for p in train.trainable_parameters()]).float()
        with torch.no_grad(), train.reference():
            ref = train.transition(batch, sde_type="sde").log_prob
        results[fuse, compiled] = (out.log_prob.detach(), grads, ref)
    logp, grads, ref = results[False, False]
    for key in ((True, False), (True, True)):
        logp_f, grads_f, ref_f = results[key]
        torch.testing.assert_close(logp_f, logp, rtol=0, atol=1e-5 if key[1] else 0)
        torch.testing.assert_close(ref_f, ref, rtol=0, atol=1e-5 if key[1] else 0)
        assert (grads_f - grads).norm() / grads.norm() < 1e-2, key
