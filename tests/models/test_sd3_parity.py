"""Trainer and rollout agree: recomputed log-probs, LoRA / full weight round trips."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from omnirl.models.base import WeightLoadError
from omnirl.models.sd3 import SD3RolloutAdapter, SD3TrainingAdapter
from omnirl.models.transitions import collate_transitions
from omnirl.models.weights import full_state, lora_state
from omnirl.protocol.messages import PromptSpec, SamplingParams

pytestmark = pytest.mark.usefixtures("torch_one_thread")
LORA = {"r": 4, "lora_alpha": 8}


@pytest.fixture(scope="module")
def trainer(tiny_sd3_path, test_device):
    train = SD3TrainingAdapter.from_pretrained(tiny_sd3_path, device=test_device, lora=LORA)
    # a LoRA fresh from init is a no-op (B = 0); move it so that parity means something
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in train.trainable_parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen).to(p.device))
    return train


@pytest.fixture(scope="module")
def rollout(tiny_sd3_path, trainer, test_device):
    roll = SD3RolloutAdapter.from_pretrained(
        tiny_sd3_path, device=test_device, lora=LORA, max_sequence_length=16
    )
    roll.load_weights("lora", trainer.export_weights())
    return roll


def sample(rollout, sde_type: str, **kw):
    sp = SamplingParams(
        group_size=2,
        num_steps=4,
        height=32,
        width=32,
        sde_type=sde_type,
        sde_window=(0, 3),
        seed=11,
        **kw,
    )
    ps = [PromptSpec(group_id=f"p{i}", text=t) for i, t in enumerate(["a cat", "a blue dog"])]
    return rollout.sample(ps, sp, lease_id="l", worker_id="w", policy_version=1)


@pytest.mark.parametrize("sde_type", ["sde", "cps", "dance_sde"])
def test_recomputed_log_prob_equals_recorded(trainer, rollout, sde_type):
    groups = sample(rollout, sde_type)
    for k in range(3):
        batch = collate_transitions(groups, k)
        with torch.no_grad():
            out = trainer.transition(batch, sde_type=sde_type)
        assert out.log_prob.dtype == torch.float32 and out.log_prob.shape == (4,)
        ratio = torch.exp(out.log_prob.cpu() - batch.old_log_probs)
        torch.testing.assert_close(ratio, torch.ones_like(ratio), atol=1e-5, rtol=0)


def test_parity_without_cfg_and_on_a_micro_batch(trainer, rollout):
    groups = sample(rollout, "sde", guidance_scale=1.0)
    batch = collate_transitions(groups, 1)
    assert not batch.do_cfg
    with torch.no_grad():
        full = trainer.transition(batch, sde_type="sde").log_prob.cpu()
        half = trainer.transition(batch.select([1, 2]), sde_type="sde").log_prob.cpu()
    torch.testing.assert_close(full, batch.old_log_probs, atol=1e-5, rtol=0)
    torch.testing.assert_close(half, full[1:3], atol=1e-5, rtol=0)


def test_gradients_reach_only_lora_and_reference_disables_it(trainer, rollout):
    batch = collate_transitions(sample(rollout, "sde"), 0)
    out = trainer.transition(batch, sde_type="sde")
    out.log_prob.mean().backward()
    trainable = {id(p) for p in trainer.trainable_parameters()}
    assert trainable and all(
        "lora_" in n for n, p in trainer.transformer.named_parameters() if id(p) in trainable
    )
    assert all(p.grad is not None for p in trainer.trainable_parameters())
    assert all(p.grad is None for p in trainer.transformer.parameters() if id(p) not in trainable)
    for p in trainer.trainable_parameters():
        p.grad = None
    with torch.no_grad():
        with trainer.reference():
            ref = trainer.transition(batch, sde_type="sde")
        after = trainer.transition(batch, sde_type="sde")
    assert not torch.allclose(ref.prev_sample_mean, out.prev_sample_mean.detach(), atol=1e-6)
    torch.testing.assert_close(after.log_prob, out.log_prob.detach())  # adapter back on


def test_lora_update_changes_rollout_and_matches_trainer(
    tiny_sd3_path, trainer, rollout, test_device
):
    before = sample(rollout, "sde")[0]
    update = trainer.export_weights()
    assert update and all(t.device.type == "cpu" and t.is_contiguous() for t in update.values())
    assert all(".lora_A.weight" in k or ".lora_B.weight" in k for k in update)
    with torch.no_grad():
        for p in trainer.trainable_parameters():
            p.mul_(1.5)
    rollout.load_weights("lora", trainer.export_weights())
    groups = sample(rollout, "sde")
    assert not torch.allclose(groups[0].final_latents, before.final_latents, atol=1e-4)
    batch = collate_transitions(groups, 2)
    with torch.no_grad():
        new = trainer.transition(batch, sde_type="sde").log_prob.cpu()
    torch.testing.assert_close(new, batch.old_log_probs, atol=1e-5, rtol=0)
    # a rollout without an adapter creates one from the update's adapter_config
    bare = SD3RolloutAdapter.from_pretrained(
        tiny_sd3_path, device=test_device, max_sequence_length=16
    )
    with pytest.raises(WeightLoadError, match="adapter_config"):
        bare.load_weights("lora", trainer.export_weights())
    bare.load_weights("lora", trainer.export_weights(), adapter_config=trainer.adapter_config())
    torch.testing.assert_close(sample(bare, "sde")[0].log_probs, groups[0].log_probs)


def test_bad_update_is_refused_and_leaves_model_unchanged(rollout):
    good = lora_state(rollout.transformer)
    snapshot = full_state(rollout.transformer)
    name = sorted(good)[0]
    bad_shape = dict(good)
    bad_shape[name] = torch.zeros(good[name].shape[0] + 1, *good[name].shape[1:])
    bad_shape[sorted(good)[1]] = good[sorted(good)[1]] + 1.0  # a good change that must not land
    nan = dict(good, **{name: torch.full_like(good[name], float("nan"))})
    unknown = dict(good, **{"no.such.lora_A.weight": torch.zeros(1)})
    missing = {k: v for k, v in good.items() if k != name}
    cases = [
        (bad_shape, "shape"),
        (nan, "NaN"),
        (unknown, "unknown names"),
        (missing, "missing names"),
    ]
    for tensors, why in cases:
        with pytest.raises(WeightLoadError, match=why):
            rollout.load_weights("lora", tensors)
    with pytest.raises(WeightLoadError, match="unknown weight format"):
        rollout.load_weights("delta", good)
    after = full_state(rollout.transformer)
    assert all(torch.equal(snapshot[k], after[k]) for k in snapshot)


def test_full_finetune_round_trip_and_lazy_reference(tiny_sd3_path, test_device):
    train = SD3TrainingAdapter.from_pretrained(tiny_sd3_path, device=test_device)
    assert train.weight_format == "full" and train.adapter_config() == {}
    n_params = sum(1 for _ in train.transformer.parameters())
    assert len(train.trainable_parameters()) == n_params
    with torch.no_grad():
        for p in train.trainable_parameters():
            p.add_(0.01)
    roll = SD3RolloutAdapter.from_pretrained(
        tiny_sd3_path, device=test_device, max_sequence_length=16
    )
    roll.load_weights("full", train.export_weights())
    groups = sample(roll, "dance_sde")
    batch = collate_transitions(groups, 0)
    assert train._reference_model is None
    with torch.no_grad():
        policy = train.transition(batch, sde_type="dance_sde")
        with train.reference():
            ref = train.transition(batch, sde_type="dance_sde")
    torch.testing.assert_close(policy.log_prob.cpu(), batch.old_log_probs, atol=1e-5, rtol=0)
    assert train._reference_model is not None
    assert not torch.allclose(ref.prev_sample_mean, policy.prev_sample_mean, atol=1e-5)


def test_save_pretrained_loads_with_diffusers_load_lora_weights(tmp_path, tiny_sd3_path, trainer):
    from diffusers import StableDiffusion3Pipeline
    from peft.utils import get_peft_model_state_dict

    trainer.save_pretrained(tmp_path / "lora")
    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_sd3_path)
    pipe.load_lora_weights(tmp_path / "lora")
    adapter = pipe.transformer.active_adapters()[0]
    loaded = get_peft_model_state_dict(pipe.transformer, adapter_name=adapter)
    exported = trainer.export_weights()
    assert loaded.keys() == exported.keys()
    assert all(torch.equal(loaded[k], exported[k]) for k in exported)


def test_gradient_checkpointing_gives_the_same_log_prob_and_grads(
    tiny_sd3_path, rollout, test_device
):
    batch = collate_transitions(sample(rollout, "sde"), 1)
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)  # same LoRA init
        train = SD3TrainingAdapter.from_pretrained(
            tiny_sd3_path, device=test_device, lora=LORA, gradient_checkpointing=checkpointing
        )
        assert train.transformer.is_gradient_checkpointing == checkpointing
        with torch.no_grad():
            for p in train.trainable_parameters():
                p.add_(0.01)
        train.transition(batch, sde_type="sde").log_prob.sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in train.trainable_parameters()]))
    torch.testing.assert_close(grads[0], grads[1])


def test_bf16_model_with_fp32_lora_keeps_exact_parity(tiny_sd3_path, test_device):
    kw = {"device": test_device, "dtype": torch.bfloat16, "lora": LORA}
    train = SD3TrainingAdapter.from_pretrained(tiny_sd3_path, **kw)
    roll = SD3RolloutAdapter.from_pretrained(tiny_sd3_path, **kw)
    for adapter in (train, roll):
        dtypes = {p.dtype for n, p in adapter.transformer.named_parameters() if "lora_" in n}
        assert dtypes == {torch.float32}  # same adapter kernels on both sides
    with torch.no_grad():
        for p in train.trainable_parameters():
            p.add_(0.05)
    roll.load_weights("lora", train.export_weights())
    groups = sample(roll, "sde")
    assert groups[0].prompt_embeds.dtype == torch.bfloat16
    assert groups[0].latents.dtype == torch.float32
    batch = collate_transitions(groups, 1)
    with torch.no_grad():
        new = train.transition(batch, sde_type="sde").log_prob.cpu()
    torch.testing.assert_close(new, batch.old_log_probs, atol=1e-5, rtol=0)


def _rows_per_call(module: torch.nn.Module) -> tuple[list[int], object]:
    rows: list[int] = []
    hook = module.register_forward_pre_hook(
        lambda _m, _a, kw: rows.append(int(kw["hidden_states"].shape[0])), with_kwargs=True
    )
    return rows, hook


def test_shared_initial_noise_runs_the_model_once_per_group_with_the_same_numbers(trainer, rollout):
    """Before a group's first stochastic step its samples share one input: both sides run the
    transformer on one row per group there, and the log-probs and gradients are those of
    running every row."""
    rows, hook = _rows_per_call(rollout.transformer)
    try:
        groups = sample(rollout, "sde", same_initial_noise=True)
    finally:
        hook.remove()
    # 2 prompts x 2 samples, CFG doubles the rows; step 0 is the window's first (stochastic)
    assert rows == [4, 8, 8, 8]
    batch = collate_transitions(groups, 0)
    assert batch.input_id.tolist() == [0, 0, 2, 2]
    distinct = dataclasses.replace(batch, input_id=None)
    rows, hook = _rows_per_call(trainer.transformer)
    grads, log_probs = [], []
    try:
        for b in (batch, distinct):
            out = trainer.transition(b, sde_type="sde")
            (out.log_prob * torch.arange(1.0, 5.0, device=out.log_prob.device)).sum().backward()
            log_probs.append(out.log_prob.detach().cpu())
            grads.append(torch.cat([p.grad.flatten() for p in trainer.trainable_parameters()]))
            trainer.transformer.zero_grad(set_to_none=True)
    finally:
        hook.remove()
    assert rows == [4, 8]
    torch.testing.assert_close(log_probs[0], batch.old_log_probs, atol=1e-5, rtol=0)
    torch.testing.assert_close(log_probs[0], log_probs[1], atol=1e-6, rtol=0)
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-4)
    assert grads[0].abs().max() > 0
