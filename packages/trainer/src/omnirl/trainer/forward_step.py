"""``ForwardProcessStep``: the training step of log-prob-free, forward-process objectives.

:class:`~omnirl.trainer.step.TrainStep` hands an algorithm whose spec says
``needs_log_probs=False`` to this class (same surface: ``step``, ``state_dict``,
``load_state_dict``). It trains DiffusionNFT (units: samples) and Diffusion-DPO (units:
the (best, worst) pair of each group; the loss says ``pairs = True``). Its groups need only ``final_latents`` (the clean samples ``x0``),
their conditioning and rewards; the trainer re-noises ``x0`` itself. One call:

1. computes group advantages (the algorithm's estimator), skips groups whose advantages are
   all zero;
2. draws, per unit, ``max(1, int(T * timestep_fraction))`` distinct noise levels of the
   group's ``T``-step sampling schedule (a random permutation per sample, as NVlabs'
   DiffusionNFT does; ``timestep_selection`` is not used);
3. for each optimiser update, for each drawn level and micro-batch: ``x_t = (1 - t) x0 + t eps``
   with fresh noise from the step's seeded generator (one noise per pair for DPO), the
   velocities of the trained policy, of the lagging *old* policy (the trainable parameters'
   lagging copy swapped in, no grad) if the loss asks (NFT), and of the reference if the
   loss asks; accumulates the gradient of the loss averaged over every (unit, level);
4. clips the gradient norm, steps AdamW, updates the (evaluation) EMA; after the call moves
   the old policy towards the trained one: ``old <- d old + (1 - d) theta``,
   ``d = min(old_decay_rate * n, old_decay_max)`` after ``n`` optimiser updates.

Shapes: ``N`` trained samples, ``U`` units, ``T`` schedule steps, ``J`` drawn levels per
unit, ``B`` units of a micro-batch.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from omnirl.models.base import DiffusionTrainingAdapter
from omnirl.models.clean_batch import CleanSampleBatch, collate_clean_samples
from omnirl.models.transitions import TransitionBatchError
from omnirl.protocol.messages import DiffusionTrajectoryGroup
from omnirl.trainer.algorithms.diffusion_dpo import DPOLossInputs, preference_pair
from omnirl.trainer.algorithms.diffusion_nft import NFTLossInputs, old_policy_decay
from omnirl.trainer.algorithms.flow_grpo import LossOutput
from omnirl.trainer.algorithms.registry import (
    AlgorithmSpec,
    build_loss,
    get_advantage,
    needs_reference_pass,
)
from omnirl.trainer.algorithms.update_metrics import MetricsAccumulator, batch_metrics
from omnirl.trainer.ema import EMA
from omnirl.trainer.optim import OptimConfig, build_adamw, set_lr, trainable


class ForwardProcessStep:
    """One DiffusionNFT-style optimisation step over a batch of scored groups."""

    def __init__(
        self,
        adapter: DiffusionTrainingAdapter,
        algorithm: AlgorithmSpec,
        config: Any = None,
    ) -> None:
        from omnirl.trainer.step import TrainStep

        self.adapter = adapter
        self.spec = algorithm
        self.config = (config or TrainStep.Config()).resolve(self.spec)
        cfg = self.config
        if not 0 <= cfg.old_decay_max < 1 or not cfg.old_decay_rate >= 0:
            raise ValueError(
                "TrainStep.Config out of range: old_decay_rate must be >= 0 and old_decay_max "
                f"in [0, 1), got {cfg.old_decay_rate!r}, {cfg.old_decay_max!r}"
            )
        self.estimator = get_advantage(self.spec.advantage)
        self.loss = build_loss(self.spec, cfg)
        self.pairs = bool(getattr(type(self.loss), "pairs", False))
        self.needs_reference = needs_reference_pass(self.spec, self.loss)
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
        # The old policy: a float32 copy of the trainable parameters, equal to them at the
        # start; its decay is set from the schedule before each move (warmup off).
        self.old = EMA(self.params, decay=0.0, warmup=False) if self.loss.needs_old() else None
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
        """Train on ``groups`` (rewards and ``final_latents`` set) at version ``policy_version``,
        at learning rate ``config.lr * lr_scale``.

        A group up to any number of versions old is trained as a fresh one: the objective
        reads only its clean samples and rewards (the server enforces ``max_staleness``).
        """
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
        metrics.update(acc.summary())
        for name in ("optimality", "old_deviation", "implicit_accuracy", "model_diff"):
            parts = acc.samples.get(name)
            metrics[f"{name}_mean"] = float(torch.cat(parts).mean()) if parts else 0.0
        if self.old is not None:
            metrics["old_decay"] = float(self.old.decay)
        metrics["time_s"] = time.perf_counter() - start
        return metrics

    def state_dict(self) -> dict[str, Any]:
        return {
            "optimizer": self.optimizer.state_dict(),
            "ema": self.ema.state_dict() if self.ema is not None else None,
            "old": self.old.state_dict() if self.old is not None else None,
            "generator": self.generator.get_state(),
            "num_updates": self.num_updates,
            "algorithm": self.spec.name,
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
        if self.old is not None:
            self.old.load_state_dict(state["old"])
        self.generator.set_state(state["generator"])
        self.num_updates = int(state["num_updates"])

    # ---------------------------------------------------------------------------- private

    def _check(self, groups: Sequence[DiffusionTrajectoryGroup], policy_version: int) -> None:
        from omnirl.trainer.step import TrainStepInputError

        if not groups:
            raise TrainStepInputError("no groups to train on")
        for g in groups:
            if g.rewards is None:
                raise TrainStepInputError(f"group {g.group_id!r} has no rewards")
            if g.final_latents is None:
                raise TrainStepInputError(
                    f"group {g.group_id!r} carries no final_latents; algorithm "
                    f"{self.spec.name!r} trains on the clean samples"
                )
            size = int(g.final_latents.shape[0])
            if len(g.rewards.total) != size:
                raise TrainStepInputError(
                    f"group {g.group_id!r} has {len(g.rewards.total)} rewards for {size} samples"
                )
            if g.policy_version > policy_version:
                raise TrainStepInputError(
                    f"group {g.group_id!r} comes from version {g.policy_version}, newer than "
                    f"the trainer's {policy_version}"
                )

    def _train(
        self,
        groups: list[DiffusionTrajectoryGroup],
        advantages: torch.Tensor,
        acc: MetricsAccumulator,
    ) -> None:
        from omnirl.trainer.step import TrainStepInputError

        cfg = self.config
        try:
            batch = collate_clean_samples(groups, device=self.device)
        except TransitionBatchError as err:
            raise TrainStepInputError(str(err)) from err
        num_t = batch.num_steps
        sigmas = self.adapter.sampling_sigmas(num_t, tuple(batch.latents.shape[-2:]))  # [T]
        units = self._units(groups)  # [U, 1] sample rows, or [U, 2] (chosen, rejected) rows
        num_units = int(units.shape[0])
        num_j = max(1, int(num_t * cfg.timestep_fraction))
        order = torch.stack(
            [torch.randperm(num_t, generator=self.generator)[:num_j] for _ in range(num_units)]
        )  # [U, J]
        levels = sigmas.to(torch.float32)[order]  # [U, J] noise level t of each (unit, level)
        acc.set_shape(num_samples=int(units.numel()), trained_steps=num_j)
        for _ in range(cfg.inner_epochs):
            perm = torch.randperm(num_units, generator=self.generator)
            for chosen in perm.tensor_split(min(cfg.num_minibatches, num_units)):
                self._update(batch, units, chosen, advantages, levels, acc)
        if self.old is None:
            return
        self.old.decay = old_policy_decay(
            self.num_updates, rate=cfg.old_decay_rate, max_decay=cfg.old_decay_max
        )
        self.old.update()

    def _units(self, groups: list[DiffusionTrajectoryGroup]) -> torch.Tensor:
        """Rows of the collated batch each unit trains on: ``[N, 1]`` or ``[U, 2]`` pairs."""
        sizes = [int(g.final_latents.shape[0]) for g in groups]
        if not self.pairs:
            return torch.arange(sum(sizes)).unsqueeze(1)
        out, offset = [], 0
        for g, n in zip(groups, sizes, strict=True):
            chosen, rejected = preference_pair(g.rewards.total)  # kept groups never tie
            out.append([offset + chosen, offset + rejected])
            offset += n
        return torch.tensor(out, dtype=torch.long)

    def _update(
        self,
        batch: CleanSampleBatch,
        units: torch.Tensor,
        chosen: torch.Tensor,
        advantages: torch.Tensor,
        levels: torch.Tensor,
        acc: MetricsAccumulator,
    ) -> None:
        """One optimiser update over the units ``chosen`` (indices into ``units``)."""
        cfg = self.config
        self.optimizer.zero_grad(set_to_none=True)
        chunk = cfg.micro_batch_size or len(chosen)
        num_j = int(levels.shape[1])
        totals = {"loss": 0.0, "policy_loss": 0.0, "kl": 0.0}
        for j in range(num_j):
            for micro in chosen.split(chunk):
                t = levels[micro, j].to(self.device)  # [B]
                if self.pairs:
                    res = self._dpo_loss(batch, units[micro], t)
                else:
                    res = self._nft_loss(batch, units[micro, 0], t, advantages)
                # Weight so the gradient is that of the mean over every (unit, level) pair.
                weight = len(micro) / (len(chosen) * num_j)
                (res.loss * weight).backward()
                totals["loss"] += float(res.loss.detach()) * weight
                totals["policy_loss"] += float(res.policy_loss) * weight
                totals["kl"] += float(res.kl) * weight
                acc.add_samples(res.per_sample)
        max_norm = cfg.max_grad_norm or math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
        if math.isfinite(grad_norm):
            self.optimizer.step()
            if self.ema is not None:
                self.ema.update()
            self.num_updates += 1
        else:  # never let one bad batch write NaNs into the weights
            acc.nonfinite_updates += 1
        self.optimizer.zero_grad(set_to_none=True)
        acc.add_update(grad_norm=grad_norm, **totals)

    def _noise(self, x0: torch.Tensor) -> torch.Tensor:
        """Fresh standard normal noise of ``x0``'s shape from the step's seeded generator."""
        return torch.randn(x0.shape, generator=self.generator).to(self.device)

    def _nft_loss(
        self, batch: CleanSampleBatch, rows: torch.Tensor, t: torch.Tensor, advantages
    ) -> LossOutput:
        """NFT on sample ``rows [B]`` at levels ``t [B]``."""
        mb = batch.select(rows)
        x0 = mb.latents
        t_b = t.view(-1, *([1] * (x0.dim() - 1)))
        x_t = (1.0 - t_b) * x0 + t_b * self._noise(x0)
        timesteps = t * 1000.0
        with torch.no_grad(), self.old.swapped_in():
            v_old = self.adapter.velocity(x_t, timesteps, mb)
        v_ref = None
        if self.needs_reference:
            with torch.no_grad(), self.adapter.reference():
                v_ref = self.adapter.velocity(x_t, timesteps, mb)
        v_theta = self.adapter.velocity(x_t, timesteps, mb)
        return self.loss(
            NFTLossInputs(
                x0=x0,
                x_t=x_t,
                t=t,
                v_theta=v_theta,
                v_old=v_old,
                v_ref=v_ref,
                advantages=advantages[rows.to(self.device)],
            )
        )

    def _dpo_loss(
        self, batch: CleanSampleBatch, pairs: torch.Tensor, t: torch.Tensor
    ) -> LossOutput:
        """DPO on ``pairs [B, 2]`` (chosen, rejected rows) at levels ``t [B]``: one shared
        noise and level per pair; the ``2B`` rows go through the model in one call."""
        b = int(pairs.shape[0])
        mb = batch.select(torch.cat([pairs[:, 0], pairs[:, 1]]))
        x0 = mb.latents  # [2B, ...], chosen first
        eps = self._noise(x0[:b]).repeat(2, *([1] * (x0.dim() - 1)))
        t2 = torch.cat([t, t])
        t_b = t2.view(-1, *([1] * (x0.dim() - 1)))
        x_t = (1.0 - t_b) * x0 + t_b * eps
        timesteps = t2 * 1000.0
        with torch.no_grad(), self.adapter.reference():
            v_ref = self.adapter.velocity(x_t, timesteps, mb)
        v_theta = self.adapter.velocity(x_t, timesteps, mb)
        target = eps - x0
        return self.loss(
            DPOLossInputs(
                target_w=target[:b],
                target_l=target[b:],
                v_theta_w=v_theta[:b],
                v_theta_l=v_theta[b:],
                v_ref_w=v_ref[:b],
                v_ref_l=v_ref[b:],
            )
        )
