"""A training step that fails after an optimiser update leaves no trace: the backend puts
back the weights, the optimiser moments, the EMA and the step's generator from a snapshot
taken before it, so that its groups, issued again, are trained on once. Without a snapshot
such a failure stops the run instead.

The tiny SD3 trainer makes two updates a step (``num_minibatches=2``); its gradient forward
raises in the second, after the first update went into the weights.
"""

from __future__ import annotations

import pytest
import torch

from omnirl.trainer.backend import AdapterBackend
from omnirl.trainer.config import load_config
from omnirl.trainer.step_snapshot import StepNotUndone, snapshot_steps, trainable_state_bytes


def test_when_steps_are_snapshotted():
    small, large = 300 << 20, 15 << 30  # a LoRA; a full fine-tune of SD3.5-M
    assert snapshot_steps("auto", state_bytes=small, updates_per_step=1)
    assert not snapshot_steps("auto", state_bytes=large, updates_per_step=1)
    assert snapshot_steps("auto", state_bytes=large, updates_per_step=2)
    assert snapshot_steps("always", state_bytes=large, updates_per_step=1)
    assert not snapshot_steps("never", state_bytes=small, updates_per_step=4)
    with pytest.raises(ValueError, match="unknown step_snapshot 'sometimes'"):
        snapshot_steps("sometimes", state_bytes=small, updates_per_step=1)
    params = [torch.zeros(4, 8), torch.zeros(8, dtype=torch.bfloat16)]
    assert trainable_state_bytes(params) == 3 * (32 * 4 + 8 * 2)


def _backend(path, tmp_path, device, *overrides: str) -> AdapterBackend:
    cfg = load_config(
        None,
        [
            f"model.path={path}",
            f"run.device={device}",
            f"data.prompts={tmp_path / 'p.jsonl'}",
            "model.lora.r=4",
            "model.lora.alpha=4",
            "train.lr=1e-2",
            "algorithm.overrides.num_minibatches=2",
            "algorithm.overrides.micro_batch_size=4",
            "algorithm.overrides.ema_decay=0.9",
            *overrides,
        ],
    )
    return AdapterBackend(cfg)


def _state(backend: AdapterBackend) -> list[torch.Tensor]:
    """Every tensor a step changes: parameters, Adam's moments and counts, the EMA's shadow,
    the step's generator."""
    step = backend.train_step
    tensors = [p.detach().clone() for p in step.params]
    for per_param in step.optimizer.state_dict()["state"].values():
        tensors.extend(v.clone() for v in per_param.values())
    tensors.extend(s.clone() for s in step.ema.shadow)
    tensors.append(step.generator.get_state())
    return tensors


def _assert_same(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


class FailsInSecondMinibatch:
    """The adapter's ``transition``, raising in the second minibatch's gradient forward."""

    def __init__(self, adapter):
        self.inner, self.calls = adapter.transition, 0

    def __call__(self, batch, **kwargs):
        if torch.is_grad_enabled():
            self.calls += 1
            if self.calls > 2:  # the first minibatch's two timesteps went through
                raise RuntimeError("a kernel failed")
        return self.inner(batch, **kwargs)


def test_a_failed_step_is_undone_and_its_retry_is_the_step_that_never_failed(
    tiny_sd3_path, tiny_sd3_groups, tmp_path, test_device
):
    # on a GPU (OMNIRL_TEST_DEVICE=cuda) the snapshot's copies are asynchronous, into
    # page-locked buffers
    backend = _backend(tiny_sd3_path, tmp_path, test_device)
    assert backend.snapshot is not None
    metrics = backend.step(tiny_sd3_groups, policy_version=0)  # the optimiser has moments now
    assert metrics["snapshot_s"] > 0
    before = _state(backend)
    real = backend.adapter.transition
    backend.adapter.transition = FailsInSecondMinibatch(backend.adapter)
    with pytest.raises(RuntimeError, match="a kernel failed"):
        backend.step(tiny_sd3_groups, policy_version=1)
    assert backend.train_step.num_updates == 2  # the first step's two, not three
    _assert_same(_state(backend), before)

    backend.adapter.transition = real
    backend.step(tiny_sd3_groups, policy_version=1)
    never_failed = _backend(tiny_sd3_path, tmp_path, test_device)
    never_failed.step(tiny_sd3_groups, policy_version=0)
    never_failed.step(tiny_sd3_groups, policy_version=1)
    _assert_same(_state(backend), _state(never_failed))


def test_without_a_snapshot_a_step_that_changed_the_weights_cannot_be_undone(
    tiny_sd3_path, tiny_sd3_groups, tmp_path, test_device
):
    backend = _backend(tiny_sd3_path, tmp_path, test_device, "train.step_snapshot=never")
    assert backend.snapshot is None
    backend.adapter.transition = FailsInSecondMinibatch(backend.adapter)
    with pytest.raises(StepNotUndone, match="1 optimiser update") as caught:
        backend.step(tiny_sd3_groups, policy_version=0)
    assert caught.value.stop_run
    assert isinstance(caught.value.__context__, RuntimeError)  # the failure, in the log
