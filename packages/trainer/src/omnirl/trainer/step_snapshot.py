"""Undoing a training step that failed after it had changed the weights.

A step whose groups are issued again after a failure must leave no trace, or the groups'
samples are trained on twice. A step fails cleanly when the error comes before its first
optimiser update. With several updates a step (``num_minibatches`` or ``inner_epochs``
above 1), or an error after the update (the EMA, float8 recalibration in ``on_update``, the
metrics), part of it is already in the weights. So before such a step the backend copies
what a step changes into host memory (:class:`StepSnapshot`) and puts it back if the step
fails (:func:`rewind`).

``train.step_snapshot`` chooses when: ``auto`` snapshots every step whose trainable state
(the parameters and Adam's two moments) takes at most ``AUTO_SNAPSHOT_BYTES`` (a LoRA, even
SD3.5-M's r32 at 0.5 % of an update, ``docs/gpu_sessions.md``, "GPU, thirteenth session"; a
small model trained whole), and a larger one's only when the step makes several updates (a
full fine-tune of SD3.5-M would copy about three times its weights); ``always``; ``never``. A failed step
that changed the weights with no snapshot to undo it raises :class:`StepNotUndone`,
and the server stops the run without writing a checkpoint of those weights.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from omnirl.models.device import synchronize
from omnirl.trainer.config import SNAPSHOT_POLICIES


class StepNotUndone(RuntimeError):
    """A failed step may have left its mark on the weights and cannot be undone: issuing its
    groups again would train on them twice. The server stops the run, writing no checkpoint
    of those weights."""

    stop_run = True  # what the server looks for (it does not import torch)


# ``auto``'s limit on the trainable state it copies before every step
AUTO_SNAPSHOT_BYTES = 2 << 30


def trainable_state_bytes(params: Any) -> int:
    """Bytes of the parameters and Adam's two moments (kept in the parameters' dtype)."""
    return 3 * sum(p.numel() * p.element_size() for p in params)


def snapshot_steps(policy: str, *, state_bytes: int, updates_per_step: int) -> bool:
    """Whether ``train.step_snapshot`` = ``policy`` snapshots before each step, for a
    trainable state of ``state_bytes`` (:func:`trainable_state_bytes`)."""
    if policy not in SNAPSHOT_POLICIES:
        raise ValueError(f"unknown step_snapshot {policy!r}; known: {list(SNAPSHOT_POLICIES)}")
    if policy == "auto":
        return state_bytes <= AUTO_SNAPSHOT_BYTES or updates_per_step > 1
    return policy == "always"


def _host_copy(value: Any) -> Any:
    """``value`` with every tensor copied to host memory and every container copied."""
    return _copy_into(None, value)


def _copy_into(old: Any, value: Any) -> Any:
    """``value`` copied to host memory, into ``old``'s tensors where shapes and dtypes match
    (a snapshot taken every step reuses its buffers). Device tensors go to page-locked
    buffers without waiting: the copies run in stream order before the step's kernels that
    change the tensors, and a reader on the host synchronises first (:meth:`restore`)."""
    if isinstance(value, torch.Tensor):
        value = value.detach()
        same = (
            isinstance(old, torch.Tensor) and old.shape == value.shape and old.dtype == value.dtype
        )
        if not same:
            old = torch.empty(
                value.shape, dtype=value.dtype, pin_memory=value.device.type == "cuda"
            )
        return old.copy_(value, non_blocking=old.is_pinned())
    if isinstance(value, dict):
        olds = old if isinstance(old, dict) else {}
        return {k: _copy_into(olds.get(k), v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        olds = (
            old if isinstance(old, list | tuple) and len(old) == len(value) else [None] * len(value)
        )
        return type(value)(_copy_into(o, v) for o, v in zip(olds, value, strict=True))
    return copy.deepcopy(value)


class StepSnapshot:
    """What a ``TrainStep.step`` changes, copied to host memory before it: the trainable
    parameters and ``TrainStep.state_dict()`` (optimiser moments and step counts, the EMA, the
    step's generator, the update count, float8 scales). :meth:`take` before every step
    reuses the host buffers of the last."""

    def __init__(self, train_step: Any | None = None):
        self.params: list[torch.Tensor] | None = None
        self.state: dict[str, Any] | None = None
        if train_step is not None:
            self.take(train_step)

    def take(self, train_step: Any) -> StepSnapshot:
        """Copy ``train_step``'s state now (into the buffers of the last take)."""
        self.params = _copy_into(self.params, list(train_step.params))
        self.state = _copy_into(self.state, train_step.state_dict())
        return self

    def restore(self, train_step: Any) -> None:
        """Put ``train_step`` back as it was when this snapshot was taken."""
        if self.params is None:
            raise RuntimeError("restore of a snapshot that was never taken")
        synchronize(train_step.device)  # the copies into the host buffers have landed
        with torch.no_grad():
            for param, saved in zip(train_step.params, self.params, strict=True):
                param.copy_(saved)
        # load_state_dict may keep host tensors it is given (the optimiser's on a CPU): hand
        # it a copy, so that this snapshot's buffers are never the live state
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
