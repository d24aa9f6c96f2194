"""A step that runs out of device memory is tried again at half the micro-batch, and its
update is the update the smaller micro-batch makes from the start.

A CPU cannot run out of memory on cue, so the tiny SD3 trainer's gradient forward raises
``torch.OutOfMemoryError`` (what a GPU raises) for micro-batches over a row limit, as a
card with that much room would. Everything else is the real TrainStep.
"""

from __future__ import annotations

import io

import pytest
import torch

from omnirl.models.registry import get_training_adapter
from omnirl.trainer.memory_fallback import step_with_memory_fallback
from omnirl.trainer.step import TrainStep
from omnirl.trainer.step_snapshot import StepSnapshot

ARCH = "StableDiffusion3Pipeline"
LORA = {"r": 4, "lora_alpha": 4}


class RowLimit:
    """The adapter's ``transition``, out of memory for a gradient pass over ``limit`` rows."""

    def __init__(self, adapter, limit: int):
        self.inner, self.limit = adapter.transition, limit
        self.refused: list[int] = []

    def __call__(self, batch, **kwargs):
        rows = int(batch.latents.shape[0])
        if torch.is_grad_enabled() and rows > self.limit:
            self.refused.append(rows)
            raise torch.OutOfMemoryError(f"CUDA out of memory ({rows} rows)")
        return self.inner(batch, **kwargs)


def _step(path, **config):
    torch.manual_seed(0)  # the same LoRA initialisation for every trainer
    adapter = get_training_adapter(ARCH, "flow_grpo").from_pretrained(path, device="cpu", lora=LORA)
    return TrainStep(adapter, "flow_grpo", TrainStep.Config(lr=1e-2, **config))


def _lora(step):
    return [p.detach().clone() for p in step.adapter.trainable_parameters()]


def test_an_out_of_memory_step_is_retried_at_half_the_micro_batch(tiny_sd3_path, tiny_sd3_groups):
    step = _step(tiny_sd3_path, micro_batch_size=8)
    limit = step.adapter.transition = RowLimit(step.adapter, 2)
    before = _lora(step)
    released = []
    metrics = step_with_memory_fallback(
        step, tiny_sd3_groups, policy_version=0, lr_scale=1.0, release=lambda: released.append(1)
    )
    assert limit.refused == [8, 4]  # 8 -> 4 -> 2
    assert len(released) == 2
    assert step.config.micro_batch_size == 2
    assert metrics["micro_batch_fallbacks"] == 2 and metrics["micro_batch_size"] == 2
    assert step.num_updates == 1  # one update, not one per try

    direct = _step(tiny_sd3_path, micro_batch_size=2)
    direct.step(tiny_sd3_groups, policy_version=0)
    for got, want in zip(_lora(step), _lora(direct), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert any(not torch.equal(a, b) for a, b in zip(_lora(step), before, strict=True))

    # the smaller size stays: the next step runs at 2 without a failure
    metrics = step_with_memory_fallback(
        step, tiny_sd3_groups, policy_version=1, lr_scale=1.0, release=lambda: released.append(1)
    )
    assert limit.refused == [8, 4] and "micro_batch_fallbacks" not in metrics

    # a resumed run with the same config starts at 2; one configured otherwise keeps its own
    buffer = io.BytesIO()
    torch.save(step.state_dict(), buffer)
    for configured, expected in ((8, 2), (4, 4), (0, 0)):
        resumed = _step(tiny_sd3_path, micro_batch_size=configured)
        buffer.seek(0)
        resumed.load_state_dict(torch.load(buffer, weights_only=False))
        assert resumed.config.micro_batch_size == expected
    resumed = _step(tiny_sd3_path, micro_batch_size=8)
    buffer.seek(0)
    resumed.load_state_dict(torch.load(buffer, weights_only=False))
    resumed.adapter.transition = again = RowLimit(resumed.adapter, 2)
    metrics = step_with_memory_fallback(
        resumed, tiny_sd3_groups, policy_version=2, lr_scale=1.0, release=lambda: None
    )
    assert again.refused == [] and "micro_batch_fallbacks" not in metrics


class SecondMinibatchLimit:
    """The adapter's ``transition``, out of memory for a gradient pass over more than
    ``limit`` rows once the first minibatch's two timesteps went through."""

    def __init__(self, adapter, limit: int):
        self.inner, self.limit, self.calls = adapter.transition, limit, 0

    def __call__(self, batch, **kwargs):
        if torch.is_grad_enabled():
            self.calls += 1
            if self.calls > 2 and int(batch.latents.shape[0]) > self.limit:
                raise torch.OutOfMemoryError("CUDA out of memory")
        return self.inner(batch, **kwargs)


def test_a_step_that_already_updated_the_weights_is_retried_only_from_a_snapshot(
    tiny_sd3_path, tiny_sd3_groups
):
    # two minibatches of 4 rows: the first updates the weights, the second (its 4 rows as one
    # micro-batch) runs out of memory. Without a snapshot a retry would apply the first
    # update twice, so the error propagates
    step = _step(tiny_sd3_path, micro_batch_size=4, num_minibatches=2)
    step.adapter.transition = SecondMinibatchLimit(step.adapter, 2)
    with pytest.raises(torch.OutOfMemoryError):
        step_with_memory_fallback(
            step, tiny_sd3_groups, policy_version=0, lr_scale=1.0, release=lambda: None
        )
    assert step.num_updates == 1 and step.config.micro_batch_size == 4

    # with one, the step is undone and tried again at 2: the update of a step at 2 from the
    # start (the same minibatch split too: the step's generator is restored)
    step = _step(tiny_sd3_path, micro_batch_size=4, num_minibatches=2)
    step.adapter.transition = SecondMinibatchLimit(step.adapter, 2)
    metrics = step_with_memory_fallback(
        step,
        tiny_sd3_groups,
        policy_version=0,
        lr_scale=1.0,
        release=lambda: None,
        snapshot=StepSnapshot(step),
    )
    assert metrics["micro_batch_fallbacks"] == 1 and step.num_updates == 2
    direct = _step(tiny_sd3_path, micro_batch_size=2, num_minibatches=2)
    direct.step(tiny_sd3_groups, policy_version=0)
    for got, want in zip(_lora(step), _lora(direct), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_other_errors_and_a_single_row_are_not_retried(tiny_sd3_path, tiny_sd3_groups):
    step = _step(tiny_sd3_path, micro_batch_size=1)
    step.adapter.transition = RowLimit(step.adapter, 0)
    with pytest.raises(torch.OutOfMemoryError):
        step_with_memory_fallback(
            step, tiny_sd3_groups, policy_version=0, lr_scale=1.0, release=lambda: None
        )

    step = _step(tiny_sd3_path, micro_batch_size=8)

    def broken(batch, **kwargs):
        raise ValueError("not a memory error")

    step.adapter.transition = broken
    with pytest.raises(ValueError, match="not a memory error"):
        step_with_memory_fallback(
            step, tiny_sd3_groups, policy_version=0, lr_scale=1.0, release=lambda: None
        )
    assert step.config.micro_batch_size == 8
