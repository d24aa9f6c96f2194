"""A training step that ran out of device memory, retried at half the micro-batch.

Micro-batches only split the sum behind the gradient: the update of a step is the same,
up to rounding, at any micro-batch size. So halving it trades speed for memory without
changing what is learned. A trainer that shares its GPU with a rollout worker sees the
worker's memory move from lease to lease; this keeps it training (SD3.5-M at micro-batch 16
beside a rollout worker on one 80 GB card ran out of memory and stopped the run:
``docs/gpu_sessions.md``, "GPU, twelfth session").

A step is retried only when none of it is left in the weights: no optimiser update had
happened before the error, or one had and the step's snapshot put the weights back
(:mod:`omnirl.trainer.step_snapshot`; a second try would otherwise apply part of it twice).
And only in one process: under ``torchrun`` one rank's retry would leave the others waiting
in a collective; the run stops there as before. The smaller size stays for the rest of the
run, logged, and reported in the metrics as ``micro_batch_size`` and
``micro_batch_fallbacks``. It is saved with the step's state, so a run resumed with the same
``micro_batch_size`` in its config starts at the smaller size instead of running out of
memory again; a config that asks for another size wins.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from omnirl.trainer.step_snapshot import StepSnapshot, rewind

log = logging.getLogger("omnirl.trainer")


def _rows_of(groups: Sequence[Any]) -> int:
    return sum(len(g.rewards.total) for g in groups)


def step_with_memory_fallback(
    train_step: Any,
    groups: Sequence[Any],
    *,
    policy_version: int,
    lr_scale: float,
    release: Callable[[], None],
    snapshot: StepSnapshot | None = None,
) -> dict[str, float]:
    """``train_step.step(groups, ...)``, retried at half the micro-batch after an
    out-of-memory error, down to one sample; ``release`` frees the device's cached memory
    between tries. One that came after an optimiser update of the step is retried only from
    ``snapshot`` (taken before the step), which puts the weights back first. Any other error,
    and an out-of-memory error that cannot be retried, propagates unchanged."""
    fallbacks = 0
    updates_before = train_step.num_updates
    while True:
        try:
            metrics = train_step.step(groups, policy_version=policy_version, lr_scale=lr_scale)
            break
        except torch.OutOfMemoryError as err:
            tried = train_step.config.micro_batch_size or _rows_of(groups)
            if tried <= 1 or (train_step.num_updates != updates_before and snapshot is None):
                raise
            # the frames of the failed try hold its activations: free them before the next
            traceback.clear_frames(err.__traceback__)
        rewind(train_step, snapshot, updates_before)
        release()
        train_step.config.micro_batch_size = tried // 2
        fallbacks += 1
        log.warning(
            "the training step ran out of device memory at micro-batch %d; trying again at %d "
            "for the rest of the run (algorithm.overrides.micro_batch_size=%d starts there)",
            tried,
            tried // 2,
            tried // 2,
        )
    if fallbacks:
        metrics["micro_batch_fallbacks"] = float(fallbacks)
        metrics["micro_batch_size"] = float(train_step.config.micro_batch_size)
    return metrics


def micro_batch_state(train_step: Any) -> dict[str, int]:
    """The micro-batch sizes a checkpoint keeps: the configured one and the one in use."""
    return {
        "configured": int(train_step.configured_micro_batch_size),
        "in_use": int(train_step.config.micro_batch_size),
    }


def restore_micro_batch(train_step: Any, saved: Mapping[str, int] | None) -> None:
    """Go on at the micro-batch a resumed run had fallen back to, if this run's config asks
    for the size that ran out of memory (a changed config, e.g. on a larger GPU, wins)."""
    if not saved or saved["configured"] != train_step.configured_micro_batch_size:
        return
    if saved["in_use"] != train_step.config.micro_batch_size:
        train_step.config.micro_batch_size = int(saved["in_use"])
        log.info(
            "micro-batch %d as before the resume (it fell back from %d after running out of "
            "device memory; set algorithm.overrides.micro_batch_size to another value to change)",
            saved["in_use"],
            saved["configured"],
        )
