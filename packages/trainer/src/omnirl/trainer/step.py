"""``TrainStep``: scored trajectory groups in, one optimisation step out, metrics back.

The runtime calls ``metrics = train_step.step(groups, policy_version=v)`` with groups whose
``rewards`` are set. One call:

1. computes group advantages (the algorithm's estimator) and skips groups whose
   advantages are all zero;
2. picks the recorded steps to train (``timestep_fraction`` of the ``K`` recorded window
   steps, the first ones as flow_grpo or a random subset shared by the batch);
3. for each optimiser update, recomputes the transitions' log-probs under the current
   policy, micro-batch by micro-batch and step by step, and accumulates the gradient of
   the loss averaged over every (sample, trained step) pair of the update;
4. clips the gradient norm, steps AdamW over the trainable parameters only, updates the EMA.

By default one call is one optimiser update (``inner_epochs = num_minibatches = 1``).
Shapes: ``N`` trained samples, ``K`` recorded steps, ``B`` rows of a micro-batch.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from omnirl.models.base import DiffusionTrainingAdapter
from omnirl.models.transitions import TransitionBatch, TransitionBatchError, collate_transitions
from omnirl.protocol.messages import DiffusionTrajectoryGroup
from omnirl.trainer.algorithms.flow_grpo import (
    PROX_PREV_SAMPLE_MEAN,
    LossInputs,
)
from omnirl.trainer.algorithms.registry import (
    AlgorithmSpec,
    build_loss,
    get_advantage,
    get_algorithm,
    needs_reference_pass,
)
from omnirl.trainer.algorithms.update_metrics import MetricsAccumulator, batch_metrics
from omnirl.trainer.algorithms.windows import window_buckets
from omnirl.trainer.ema import EMA
from omnirl.trainer.memory_fallback import micro_batch_state, restore_micro_batch
from omnirl.trainer.optim import OptimConfig, build_adamw, set_lr, trainable
from omnirl.trainer.step_config import TrainStepConfig

if TYPE_CHECKING:
    from omnirl.trainer.distributed import DataParallel


class TrainStepInputError(ValueError):
    """The groups handed to :meth:`TrainStep.step` cannot be trained on; nothing changed."""


class TrainStep:
    """One FlowGRPO-family optimisation step over a batch of scored groups.

    An algorithm whose spec says ``needs_log_probs=False`` (a forward-process objective)
    gets a :class:`omnirl.trainer.forward_step.ForwardProcessStep` instead, with the same
    public surface (``step``, ``state_dict``, ``load_state_dict``, ``config``, ``spec``).
    """

    def __new__(cls, adapter=None, algorithm=None, config=None, *, parallel=None):
        spec = get_algorithm(algorithm) if isinstance(algorithm, str) else algorithm
        if cls is TrainStep and spec is not None and not spec.needs_log_probs:
            from omnirl.trainer.forward_step import ForwardProcessStep

            if parallel is not None:
                raise NotImplementedError(
                    f"algorithm {spec.name!r} (a forward-process objective) has no "
                    "data-parallel step yet"
                )
            return ForwardProcessStep(adapter, spec, config)
        return super().__new__(cls)

    Config = TrainStepConfig  # the hyper-parameters (omnirl.trainer.step_config)

    def __init__(
        self,
        adapter: DiffusionTrainingAdapter,
        algorithm: AlgorithmSpec | str,
        config: TrainStep.Config | None = None,
        *,
        parallel: DataParallel | None = None,
    ) -> None:
        """``parallel``: this process's share of a data-parallel step
        (:class:`omnirl.trainer.distributed.DataParallel`); every rank then calls
        :meth:`step` with the same groups and trains its share of the samples."""
        self.adapter = adapter
        self.parallel = parallel
        self.spec = get_algorithm(algorithm) if isinstance(algorithm, str) else algorithm
        self.config = (config or TrainStep.Config()).resolve(self.spec)
        cfg = self.config
        self.configured_micro_batch_size = cfg.micro_batch_size  # before any memory fallback
        self.estimator = get_advantage(self.spec.advantage)
        self.loss = build_loss(self.spec, cfg)
        self.needs_reference = needs_reference_pass(self.spec, self.loss)
        self.needs_prox_mean = PROX_PREV_SAMPLE_MEAN in self.loss.needs()
        self.params = trainable(adapter.trainable_parameters())
        self.device = self.params[0].device
        self.optimizer = build_adamw(
            self.params,
            OptimConfig(
                lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, eps=cfg.adam_eps
            ),
        )
        self.ema = (
            EMA(self.params, decay=cfg.ema_decay, warmup=cfg.ema_warmup) if cfg.ema_decay else None
        )
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.num_updates = 0

    # ------------------------------------------------------------------------------ public

    def step(
        self,
        groups: Sequence[DiffusionTrajectoryGroup],
        *,
        policy_version: int,
        lr_scale: float = 1.0,
    ) -> dict[str, float]:
        """Train on ``groups`` (rewards set) at trainer version ``policy_version``, at
        learning rate ``config.lr * lr_scale`` (the run's schedule, see ``lr_schedule``)."""
        start = time.perf_counter()
        self._check(groups, policy_version)
        cfg = self.config
        set_lr(self.optimizer, cfg.lr * lr_scale)
        rewards = [torch.as_tensor(g.rewards.total, dtype=torch.float64) for g in groups]
        adv = self.estimator(
            rewards,
            std=cfg.std,
            adv_clip_max=None if math.isinf(cfg.adv_clip_max) else cfg.adv_clip_max,
        )
        skipped = set(adv.zero_groups)
        kept = [g for i, g in enumerate(groups) if i not in skipped]
        metrics = batch_metrics(groups, rewards, adv.advantages, policy_version)
        metrics["skipped_groups"] = float(len(skipped))
        metrics["lr"] = cfg.lr * lr_scale
        acc = MetricsAccumulator()
        if kept:
            advantages = torch.cat(
                [a for i, a in enumerate(adv.advantages) if i not in skipped]
            ).to(self.device)
            self._train(kept, advantages, acc)
        if self.parallel is not None:
            acc = self.parallel.gather_metrics(acc)
        metrics.update(acc.summary())
        metrics["time_s"] = time.perf_counter() - start
        return metrics

    def state_dict(self) -> dict[str, Any]:
        return {
            "optimizer": self.optimizer.state_dict(),
            "ema": self.ema.state_dict() if self.ema is not None else None,
            "generator": self.generator.get_state(),
            "num_updates": self.num_updates,
            "algorithm": self.spec.name,
            "float8": self.adapter.float8_state(),  # static scales: resume without calibrating
            "micro_batch": micro_batch_state(self),  # a memory fallback outlives a resume
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("algorithm", self.spec.name) != self.spec.name:
            raise ValueError(
                f"checkpoint is for algorithm {state['algorithm']!r}, this step runs "
                f"{self.spec.name!r}"
            )
        if (state["ema"] is None) != (self.ema is None):
            raise ValueError("checkpoint and config disagree on whether the EMA is on")
        self.optimizer.load_state_dict(state["optimizer"])
        if self.ema is not None:
            self.ema.load_state_dict(state["ema"])
        self.generator.set_state(state["generator"])
        self.num_updates = int(state["num_updates"])
        if state.get("float8") is not None:
            self.adapter.load_float8_state(state["float8"])
        restore_micro_batch(self, state.get("micro_batch"))

    # ---------------------------------------------------------------------------- private

    def _check(self, groups: Sequence[DiffusionTrajectoryGroup], policy_version: int) -> None:
        if not groups:
            raise TrainStepInputError("no groups to train on")
        num_k = None
        for g in groups:
            if g.rewards is None:
                raise TrainStepInputError(f"group {g.group_id!r} has no rewards")
            if g.log_probs is None or g.latents is None:
                raise TrainStepInputError(
                    f"group {g.group_id!r} carries no recorded transitions; "
                    f"algorithm {self.spec.name!r} needs log-probs"
                )
            size = int(g.latents.shape[0])
            if len(g.rewards.total) != size:
                raise TrainStepInputError(
                    f"group {g.group_id!r} has {len(g.rewards.total)} rewards for {size} samples"
                )
            if g.sampling.sde_type != self.spec.sde_type:
                raise TrainStepInputError(
                    f"group {g.group_id!r} was sampled with sde_type {g.sampling.sde_type!r}; "
                    f"algorithm {self.spec.name!r} trains {self.spec.sde_type!r}"
                )
            if g.policy_version > policy_version:
                raise TrainStepInputError(
                    f"group {g.group_id!r} comes from version {g.policy_version}, newer than "
                    f"the trainer's {policy_version}"
                )
            k = int(g.latents.shape[1])
            if num_k is not None and k != num_k:
                raise TrainStepInputError(
                    f"groups record different numbers of steps ({num_k} and {k})"
                )
            num_k = k
        if not num_k:
            raise TrainStepInputError("groups record no steps")

    def _trained_steps(self, num_k: int) -> list[int]:
        n = max(1, int(num_k * self.config.timestep_fraction))
        if self.config.timestep_selection == "first":
            return list(range(n))
        return sorted(torch.randperm(num_k, generator=self.generator)[:n].tolist())

    def _train(
        self,
        groups: list[DiffusionTrajectoryGroup],
        advantages: torch.Tensor,
        acc: MetricsAccumulator,
    ) -> None:
        cfg = self.config
        steps = self._trained_steps(int(groups[0].latents.shape[1]))
        batches = self._collate(groups, steps)
        if self.adapter.float8_needs_calibration():  # before any log-prob of the step
            rows = slice(0, cfg.micro_batch_size or None)
            self.adapter.calibrate_float8(
                [batch.select(rows) for _, batch in batches],
                sde_type=self.spec.sde_type,
                reference=self.needs_reference,
            )
        num_samples = int(advantages.numel())
        updates = cfg.inner_epochs * cfg.num_minibatches
        # With one update per call the parameters cannot change between the start of the
        # update and the gradient forward, so the proximal log-prob is that forward's own
        # value, detached: a second no-grad pass would compute the same numbers.
        prox = None if updates == 1 else self._proximal(batches, num_samples)
        acc.set_shape(num_samples=num_samples, trained_steps=len(steps))
        for epoch in range(cfg.inner_epochs):
            perm = torch.randperm(num_samples, generator=self.generator)
            for rows in perm.tensor_split(min(cfg.num_minibatches, num_samples)):
                self._update(
                    batches, rows, advantages, prox, acc, first_epoch=epoch == 0, num_k=len(steps)
                )

    def _collate(
        self, groups: list[DiffusionTrajectoryGroup], steps: list[int]
    ) -> list[tuple[torch.Tensor, TransitionBatch]]:
        """``(sample rows [B_b], batch)`` per (window bucket, trained step).

        ``rows`` index the call's ``N`` samples (groups in order). Groups of different SDE
        windows (one per lease; stale groups keep theirs) are collated apart, so one model
        call only batches rows of one schedule step.
        """
        sizes = [int(g.latents.shape[0]) for g in groups]
        offsets = [0]
        for n in sizes[:-1]:
            offsets.append(offsets[-1] + n)
        out = []
        try:
            for members in window_buckets(groups):
                sub = [groups[i] for i in members]
                rows = torch.cat([torch.arange(offsets[i], offsets[i] + sizes[i]) for i in members])
                for k in steps:
                    out.append((rows, collate_transitions(sub, k, device=self.device)))
        except (TransitionBatchError, ValueError) as err:  # e.g. inconsistent windows
            raise TrainStepInputError(str(err)) from err
        return out

    @torch.no_grad()
    def _proximal(
        self, batches: list[tuple[torch.Tensor, TransitionBatch]], num_samples: int
    ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """``(log_prob [B_b], prev_sample_mean [B_b, ...] or None)`` per batch, under the
        parameters at the start of the call."""
        chunk = self.config.micro_batch_size or num_samples
        out = []
        for rows, batch in batches:
            outs = [
                self.adapter.transition(batch.select(part), sde_type=self.spec.sde_type)
                for part in torch.arange(len(rows)).split(chunk)
            ]
            logp = torch.cat([o.log_prob for o in outs]).detach()
            mean = (
                torch.cat([o.prev_sample_mean for o in outs]).detach()
                if self.needs_prox_mean
                else None
            )
            out.append((logp, mean))
        return out

    def _update(
        self,
        batches: list[tuple[torch.Tensor, TransitionBatch]],
        rows: torch.Tensor,
        advantages: torch.Tensor,
        prox: list[tuple[torch.Tensor, torch.Tensor | None]] | None,
        acc: MetricsAccumulator,
        *,
        first_epoch: bool,
        num_k: int,
    ) -> None:
        cfg = self.config
        sde_type = self.spec.sde_type
        par = self.parallel
        self.optimizer.zero_grad(set_to_none=True)
        chunk = cfg.micro_batch_size or len(rows)
        in_update = torch.zeros(int(advantages.numel()), dtype=torch.bool)
        in_update[rows] = True
        plan: list[tuple[int, torch.Tensor]] = []  # (batch, this update's rows of it)
        for b, (batch_rows, _) in enumerate(batches):
            local = in_update[batch_rows].nonzero().flatten()
            if len(local) == 0:
                continue
            plan.extend(
                (b, m) for m in (local.split(chunk) if par is None else par.split(local, chunk))
            )
        # loss, policy_loss, kl summed on the device: no host sync inside the loop
        totals = torch.zeros(3, dtype=torch.float64, device=self.device)
        grad_scale = 1.0 if par is None else par.grad_scale
        for i, (b, micro) in enumerate(plan):
            batch_rows, batch = batches[b]
            if par is not None:
                par.before_backward(last=i == len(plan) - 1)
            if len(micro) == 0:  # this rank's share ran out: keep FSDP's collectives in step
                self._idle_pass(batch)
                continue
            mb = batch.select(micro)
            out = self.adapter.transition(mb, sde_type=sde_type)
            ref_mean = None
            if self.needs_reference:
                with torch.no_grad(), self.adapter.reference():
                    ref_mean = self.adapter.transition(mb, sde_type=sde_type).prev_sample_mean
            dev_micro = micro.to(self.device)
            if prox is None:
                prox_k, prox_mean = out.log_prob.detach(), out.prev_sample_mean.detach()
            else:
                prox_k = prox[b][0][dev_micro]
                prox_mean = prox[b][1][dev_micro] if prox[b][1] is not None else None
            res = self.loss(
                LossInputs(
                    log_prob=out.log_prob,
                    prox_log_prob=prox_k,
                    behav_log_prob=mb.old_log_probs,
                    advantages=advantages[batch_rows[micro].to(self.device)],
                    prev_sample_mean=out.prev_sample_mean,
                    ref_prev_sample_mean=ref_mean,
                    std_dev_t=out.std_dev_t,
                    prox_prev_sample_mean=prox_mean,
                    step_std=out.step_std,
                    sqrt_dt=(mb.sigmas - mb.next_sigmas).clamp(min=0).sqrt(),
                )
            )
            # Weight so the gradient is that of the mean over every (sample, step) pair of
            # the update (all ranks' rows: ``rows`` is the whole update's).
            weight = len(micro) / (len(rows) * num_k)
            # A deterministic step (step_std 0: cps into sigma 0, noise level 0) has a
            # constant log-prob: its term is a constant, with nothing to backpropagate.
            if res.loss.requires_grad:
                (res.loss * (weight * grad_scale)).backward()
            elif par is not None and out.prev_sample_mean.requires_grad:
                # still one backward, of zero, so FSDP's hooks and collectives stay in step
                (out.prev_sample_mean.sum() * 0.0).backward()
            totals += torch.stack([res.loss.detach(), res.policy_loss, res.kl]).double() * weight
            acc.add_samples(res.per_sample)
            if first_epoch:
                acc.add_parity(prox_k - mb.old_log_probs)
        if par is not None:
            par.reduce_gradients(self.params)
            totals = par.sum(totals)
        max_norm = cfg.max_grad_norm or math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
        if math.isfinite(grad_norm):
            # counted first: an update that fails half-way has changed weights too
            # (omnirl.trainer.step_snapshot.rewind)
            self.num_updates += 1
            self.optimizer.step()
            if self.ema is not None:
                self.ema.update()
            self.adapter.on_update(self.num_updates)
        else:  # never let one bad batch write NaNs into the weights
            acc.nonfinite_updates += 1
        self.optimizer.zero_grad(set_to_none=True)
        loss, policy_loss, kl = totals.tolist()
        acc.add_update(grad_norm=grad_norm, loss=loss, policy_loss=policy_loss, kl=kl)

    def _idle_pass(self, batch: TransitionBatch) -> None:
        """The forward passes (and a zero backward) of one row, contributing nothing: a rank
        whose share of an update is shorter than another's still runs every collective."""
        mb = batch.select(torch.arange(1))
        out = self.adapter.transition(mb, sde_type=self.spec.sde_type)
        if self.needs_reference:
            with torch.no_grad(), self.adapter.reference():
                self.adapter.transition(mb, sde_type=self.spec.sde_type)
        (out.prev_sample_mean.sum() * 0.0).backward()
