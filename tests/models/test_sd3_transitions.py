"""collate_transitions: per-sample rows from group-level conditioning, and its refusals."""

from __future__ import annotations

import msgspec
import pytest
import torch

from omnirl.models.transitions import (
    SharedInputs,
    TransitionBatchError,
    collate_transitions,
    shared_inputs,
)
from omnirl.protocol.messages import DiffusionTrajectoryGroup, PromptSpec, SamplingParams

G, K, C, H, W, L, D = 3, 2, 4, 2, 2, 5, 6


def group(gid: str, *, g: int = G, steps=(1, 2), sigmas=(0.9, 0.7), num_steps: int = 4, cfg=True):
    base = float(int(gid[-1]))
    sp = SamplingParams(group_size=g, num_steps=num_steps, guidance_scale=4.5 if cfg else 1.0)
    return DiffusionTrajectoryGroup(
        group_id=gid,
        lease_id="l",
        worker_id="w",
        prompt=PromptSpec(group_id=gid, text="x"),
        sampling=sp,
        policy_version=0,
        seeds=torch.arange(g),
        step_indices=torch.tensor(steps),
        timesteps=torch.tensor(sigmas) * 1000,
        sigmas=torch.tensor(sigmas),
        next_sigmas=torch.tensor(sigmas) - 0.1,
        noise_levels=torch.full((K,), 0.7),
        latents=base + torch.arange(g * K * C * H * W, dtype=torch.float32).view(g, K, C, H, W),
        next_latents=torch.randn(g, K, C, H, W),
        log_probs=base + torch.arange(g * K, dtype=torch.float32).view(g, K),
        prompt_embeds=torch.full((L, D), base, dtype=torch.bfloat16),
        pooled_prompt_embeds=torch.full((D,), base),
        negative_prompt_embeds=torch.zeros(L, D, dtype=torch.bfloat16) if cfg else None,
        negative_pooled_prompt_embeds=torch.zeros(D) if cfg else None,
    )


def test_collate_expands_group_conditioning_per_sample():
    a, b = group("g0"), group("g1", g=2)
    batch = collate_transitions([a, b], 1)
    assert batch.batch_size == 5 and batch.step_index == 2 and batch.k == 1 and batch.num_steps == 4
    assert batch.group_index.tolist() == [0, 0, 0, 1, 1]
    assert batch.sample_index.tolist() == [0, 1, 2, 0, 1]
    assert torch.equal(batch.latents[4], b.latents[1, 1]) and batch.latents.dtype == torch.float32
    assert torch.equal(batch.old_log_probs, torch.cat([a.log_probs[:, 1], b.log_probs[:, 1]]))
    assert batch.prompt_embeds.shape == (5, L, D) and batch.prompt_embeds.dtype == torch.bfloat16
    assert batch.prompt_embeds[:, 0, 0].tolist() == [0, 0, 0, 1, 1]
    assert batch.do_cfg and batch.negative_pooled_prompt_embeds.shape == (5, D)
    assert batch.sigmas.tolist() == pytest.approx([0.7] * 5)
    assert batch.noise_levels.tolist() == pytest.approx([0.7] * 5)
    sub = batch.select([0, 4])
    assert sub.batch_size == 2 and torch.equal(sub.latents[1], batch.latents[4]) and sub.k == 1


def test_sample_mask_drops_rows():
    batch = collate_transitions([group("g0"), group("g1")], 0, sample_mask=[1, 0, 1, 0, 0, 1])
    assert batch.group_index.tolist() == [0, 0, 1] and batch.sample_index.tolist() == [0, 2, 2]
    with pytest.raises(TransitionBatchError, match="6 samples"):
        collate_transitions([group("g0"), group("g1")], 0, sample_mask=[1, 0])
    with pytest.raises(TransitionBatchError, match="no samples"):
        collate_transitions([group("g0")], 0, sample_mask=[0, 0, 0])


def test_collate_refuses_mixed_schedules_and_missing_fields():
    with pytest.raises(TransitionBatchError, match="share the SDE window"):
        collate_transitions([group("g0"), group("g1", steps=(2, 3))], 0)
    with pytest.raises(TransitionBatchError, match="num_steps"):
        collate_transitions([group("g0"), group("g1", num_steps=5)], 0)
    with pytest.raises(TransitionBatchError, match="guidance"):
        collate_transitions([group("g0"), group("g1", cfg=False)], 0)
    with pytest.raises(TransitionBatchError, match="out of range"):
        collate_transitions([group("g0")], K)
    latent_free = msgspec.structs.replace(group("g0"), latents=None)
    with pytest.raises(TransitionBatchError, match="record_latents"):
        collate_transitions([latent_free], 0)
    with pytest.raises(TransitionBatchError, match="no groups"):
        collate_transitions([], 0)


def test_rows_of_a_group_with_one_x_share_an_input_id():
    a, b = group("g0"), group("g1", g=2)
    a.latents[:, 1] = a.latents[0, 1]  # group g0's samples all at one x at k = 1
    batch = collate_transitions([a, b], 1)
    assert batch.input_id.tolist() == [0, 0, 0, 3, 4]
    shared = shared_inputs(batch.input_id)
    assert shared.first.tolist() == [0, 3, 4] and shared.inverse.tolist() == [0, 0, 0, 1, 2]
    sub = batch.select([1, 2, 4])  # ids survive micro-batching: the first row need not be in
    sub_shared = shared_inputs(sub.input_id)
    assert sub_shared.first.tolist() == [0, 2] and sub_shared.inverse.tolist() == [0, 0, 1]
    assert collate_transitions([a, b], 0).input_id is None  # no group shares an x at k = 0
    assert shared_inputs(torch.arange(5)) is None
    masked = collate_transitions([a, b], 1, sample_mask=[0, 1, 1, 1, 0])
    assert masked.input_id.tolist() == [0, 0, 2]
    assert shared_inputs(None) is None


def test_one_differing_sample_keeps_its_group_distinct():
    a = group("g0")
    a.latents[:, 0] = a.latents[0, 0]
    a.latents[2, 0, 0, 0, 0] += 1e-6
    assert collate_transitions([a], 0).input_id is None


def test_shared_inputs_of_groups():
    s = SharedInputs.of_groups(2, 3, "cpu")
    assert s.first.tolist() == [0, 3] and s.inverse.tolist() == [0, 0, 0, 1, 1, 1]
