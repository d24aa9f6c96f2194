"""The trainer's optimisation steps as the server runs them: start one when enough fresh
groups are buffered, finish it (mark its groups trained, publish the new version, log,
checkpoint when due), or handle its failure (issue its groups again, free its memory, stop
after ``MAX_STEP_FAILURES`` in a row).

:class:`StepCycle` is a part of :class:`~omnirl.trainer.server.TrainerServer` (a mixin, as
:class:`~omnirl.trainer.fleet.FleetControl` is): it uses the server's config, backend,
ledger, buffer, publisher, metrics and step thread.
"""

from __future__ import annotations

import logging
import time
import traceback
from concurrent.futures import Future
from typing import Any

from omegaconf import OmegaConf

from omnirl.protocol.errors import NonFiniteValue
from omnirl.trainer.checkpoint import save_checkpoint
from omnirl.trainer.config import checkpoint_dir
from omnirl.trainer.lr_schedule import lr_factor, run_progress, warmup_factor

log = logging.getLogger("omnirl.trainer")

MAX_STEP_FAILURES = 3  # consecutive failed optimisation steps end the run (exit code 1)


class StepCycle:
    """Start, finish and fail optimisation steps; mixed into the server."""

    def _maybe_start_step(self) -> None:
        need = self.cfg.train.groups_per_step
        if self._future is not None or self.step >= self.cfg.max_steps or len(self.buffer) < need:
            return
        fresh, stale = [], []
        for g in self.buffer:
            (
                stale if self.version - g.policy_version > self.cfg.train.max_staleness else fresh
            ).append(g)
        if stale:  # grew stale while waiting for the previous step: counted, issued again
            self.ledger.counters["groups_stale_at_step"] += len(stale)
            self.ledger.requeue_accepted([g.group_id for g in stale])
        self.buffer = fresh
        if len(self.buffer) < need:
            return
        batch, self.buffer = self.buffer[:need], self.buffer[need:]
        self._batch = batch
        self._step_started = time.perf_counter()
        self._future = self._executor.submit(
            self.backend.step, batch, policy_version=self.version, lr_scale=self._lr_scale()
        )

    @property
    def elapsed_s(self) -> float:
        """The run's wall-clock seconds: this process's since it began serving, plus what the
        checkpoint it resumed from had recorded (``max_minutes`` and the lr schedule use it)."""
        return self._elapsed_before_s + time.monotonic() - self._started

    def _lr_scale(self) -> float:
        """``train.lr_schedule`` at the run's progress towards its first limit, times the
        warm-up's factor at this step."""
        train = self.cfg.train
        progress = run_progress(
            self.step,
            self.cfg.max_steps,
            self.elapsed_s,
            self.cfg.max_minutes,
        )
        return lr_factor(train.lr_schedule, progress, train.lr_min_ratio) * warmup_factor(
            self.step, train.lr_warmup_steps
        )

    def _step_failed(self, future: Future, batch: list[Any]) -> None:
        """Log a failed step, issue its groups again and free what it held; stop after
        ``MAX_STEP_FAILURES`` in a row."""
        err = future.exception()
        log.error(
            "optimisation step %d failed; its groups will be issued again",
            self.step + 1,
            exc_info=err,
        )
        # The traceback's frames still hold the step's tensors (activations, the autograd
        # graph) until a cyclic collection: free them now, or after an out-of-memory error
        # the retry finds that memory still taken and fails as well.
        traceback.clear_frames(err.__traceback__)
        if type(err).__name__ == "OutOfMemoryError":  # torch's, without importing torch here
            log.error(
                "the step ran out of device memory: lower algorithm.overrides.micro_batch_size, "
                "set train.activation_memory_budget (with train.compile) or "
                "train.gradient_checkpointing=true (a rollout worker on the same GPU takes its "
                "share too)"
            )
        stop_run = getattr(err, "stop_run", False)  # step_snapshot.StepNotUndone
        del err, future
        release = getattr(self.backend, "release_memory", None)  # stand-ins have none
        if release is not None:
            release()
        self.counters["step_failures"] = self.counters.get("step_failures", 0) + 1
        if stop_run:
            log.error("the failed step could not be undone; stopping with no final checkpoint")
            self._diverged = True
            self.exit_code = 1
            self.request_stop()
            return
        self.ledger.requeue_accepted([g.group_id for g in batch])
        self._failures_in_a_row += 1
        if self._failures_in_a_row >= MAX_STEP_FAILURES:
            log.error("%d optimisation steps in a row failed; stopping", MAX_STEP_FAILURES)
            self.exit_code = 1
            self.request_stop()

    def _finish_step(self) -> None:
        future, self._future = self._future, None
        batch = self._batch
        if future.exception() is not None:
            self._step_failed(future, batch)
            return
        metrics = dict(future.result())
        self._failures_in_a_row = 0
        step_s = time.perf_counter() - self._step_started
        self.ledger.mark_trained([g.group_id for g in batch])
        staleness = [self.version - g.policy_version for g in batch]
        self.step += 1
        self.version += 1
        t0 = time.perf_counter()
        try:
            pushed = self.publisher.publish(
                self.weights, self.version, self.backend.export_weights()
            )
        except NonFiniteValue as err:
            # the policy itself diverged: nothing later can recover it, so stop cleanly with
            # the last good version still published, its checkpoint the latest
            log.error("step %d made the policy non-finite (%s); stopping", self.step, err)
            self._diverged = True
            self.exit_code = 1
            self.request_stop()
            return
        rewards = [r for g in batch for r in g.rewards.total]
        components: dict[str, list[float]] = {}
        for g in batch:
            for name, values in g.rewards.components.items():
                components.setdefault(name, []).extend(values)
        metrics.update(
            policy_version=self.version,
            elapsed_s=self.elapsed_s,
            step_s=step_s,
            publish_s=time.perf_counter() - t0,
            weights_pushed_to=pushed,
            weight_bytes=self.publisher.total_bytes,
            staleness_mean=sum(staleness) / len(staleness),
            staleness_max=max(staleness),
            reward_mean=sum(rewards) / max(1, len(rewards)),
            **{f"reward/{name}": sum(v) / max(1, len(v)) for name, v in components.items()},
            intake_rate=self.intake.rate(),
            **{f"ledger/{k}": v for k, v in self.ledger.summary().items()},
        )
        images = [g.images for g in batch if getattr(g, "images", None) is not None]
        self.metrics.log_step(self.step, metrics, images)
        every = self.cfg.checkpoint.every
        if every and self.step % every == 0 and self.step < self.cfg.max_steps:
            self._checkpoint()

    def _checkpoint(self, final: bool = False) -> None:
        if final and self.step == 0:
            return
        path = save_checkpoint(
            checkpoint_dir(self.cfg),
            self.step,
            state={
                "version": self.version,
                "elapsed_s": self.elapsed_s,
                "data": self.prompts.state_dict(),
                "ledger": self.ledger.state_dict(),
            },
            adapter=self.backend.adapter,
            train_step=self.backend.train_step,
            config_yaml=OmegaConf.to_yaml(self.cfg),
            keep_last=self.cfg.checkpoint.keep_last,
        )
        log.info("checkpoint %s (step %d, version %d)", path, self.step, self.version)
