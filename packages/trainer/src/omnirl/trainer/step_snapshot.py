"""Undoing a training step that failed after it had changed the weights.

A step whose groups are issued again after a failure must leave no trace, or the groups'
samples are trained on twice. A step fails cleanly when the error comes before its first
optimiser update. With several updates a step (``num_minibatches`` or ``inner_epochs``
above 1), or an error after the update (the EMA, float8 recalibration in ``on_update``, the
metrics), part of it is already in the weights. So before such a step the backend copies
what a step changes into host memory (:class:`StepSnapshot`) and puts it back if the step
fails (:func:`rewind`).

``train.step_snapshot`` chooses when: ``auto`` snapshots every LoRA step (a few MB to a few
hundred MB) and a full fine-tune's steps only when they make several updates (a full copy of
SD3.5-M's weights and optimiser moments is about 27 GB); ``always``; ``never``. A failed step
that changed the weights with no snapshot to undo it raises :class:`StepNotUndone`,
and the server stops the run without writing a checkpoint of those weights.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from omnirl.trainer.config import SNAPSHOT_POLICIES


class StepNotUndone(RuntimeError):
    """A failed step may have left its mark on the weights and cannot be undone: issuing its
    groups again would train on them twice. The server stops the run, writing no checkpoint
    of those weights."""

    stop_run = True  # what the server looks for (it does not import torch)


def snapshot_steps(policy: str, *, lora: bool, updates_per_step: int) -> bool:
    """Whether ``train.step_snapshot`` = ``policy`` snapshots before each step."""
    if policy not in SNAPSHOT_POLICIES:
        raise ValueError(f"unknown step_snapshot {policy!r}; known: {list(SNAPSHOT_POLICIES)}")
    if policy == "auto":
        return lora or updates_per_step > 1
    return policy == "always"


def _host_copy(value: Any) -> Any:
    """``value`` with every tensor copied to host memory and every container copied."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _host_copy(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_host_copy(v) for v in value)
    return copy.deepcopy(value)


class StepSnapshot:
    """What a ``TrainStep.step`` changes, copied to host memory before it: the trainable
    parameters and ``TrainStep.state_dict()`` (optimiser moments and step counts, the EMA, the
    step's generator, the update count, float8 scales)."""

    def __init__(self, train_step: Any):
        self.num_updates = train_step.num_updates
        self.params = [p.detach().to("cpu", copy=True) for p in train_step.params]
        self.state = _host_copy(train_step.state_dict())

    def restore(self, train_step: Any) -> None:
        """Put ``train_step`` back as it was when this snapshot was taken."""
        with torch.no_grad():
            for param, saved in zip(train_step.params, self.params, strict=True):
                param.copy_(saved)
        # load_state_dict copies the optimiser state onto the parameters' device; hand it a
        # copy so this snapshot stays valid for a second restore
        train_step.load_state_dict(_host_copy(self.state))
        train_step.optimizer.zero_grad(set_to_none=True)


def rewind(train_step: Any, snapshot: StepSnapshot | None, updates_before: int) -> bool:
    """After a failed step: undo it if it updated the weights. Returns whether it had (and
    was restored); raises :class:`StepNotUndone` if it had and ``snapshot`` is
    ``None``. ``updates_before``: ``train_step.num_updates`` before the step (counted
    before each optimiser update, so one that failed half-way counts)."""
    if train_step.num_updates == updates_before:
        return False
    if snapshot is None:
        raise StepNotUndone(
            f"the failed step had made {train_step.num_updates - updates_before} optimiser "
            "update(s), and no snapshot was taken to undo them (train.step_snapshot); issuing "
            "its groups again would train on them twice, so the run stops here: resume from "
            "its last checkpoint"
        )
    snapshot.restore(train_step)
    return True
