"""``trainer --preferences FILE``: offline Diffusion-DPO from a preference file, no workers.

:class:`PreferenceTrainerServer` is the replay server (:mod:`omnirl.trainer.replay`) with
another source of groups: before each chance to start a step it takes the next pairs of the
file (:class:`~omnirl.trainer.preferences.PreferenceSource`) until ``groups_per_step`` groups
are buffered, turns them into two-sample groups (chosen first, rewards ``[1, 0]``) with the
training adapter's :class:`~omnirl.models.base.SampleEncoder` (text encoders, and the VAE where
the family has one), and feeds them through the same intake and ledger path as recorded
groups, stamped with the current policy version: a preference pair is data, never stale.
Nothing is fed while a step runs, so a run depends only on the file, the seed and the config.

No rollout or reward worker is needed; a worker that asks for a lease is refused. The run ends
after ``epochs`` passes over the file (a last batch smaller than ``groups_per_step`` is not
trained), or at ``max_steps`` / ``max_minutes``, whichever comes first. Checkpoints hold the
position in the file, so ``--resume`` continues with the next pair.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from omnirl.protocol.codec import encode
from omnirl.protocol.messages import Refusal
from omnirl.trainer.config import ConfigError
from omnirl.trainer.preferences import (
    PreferenceSource,
    offline_sampling,
    preference_groups,
    read_preference_file,
)
from omnirl.trainer.replay import ReplayTrainerServer

log = logging.getLogger("omnirl.trainer")

OFFLINE_ALGORITHMS = ("diffusion_dpo",)


class PreferenceTrainerServer(ReplayTrainerServer):
    """Trains ``algorithm.name`` (``diffusion_dpo``) on the pairs of ``preferences``.

    ``encoder``: a :class:`~omnirl.models.base.SampleEncoder`; by default the training
    adapter's own (``backend.adapter.sample_encoder()``).
    """

    def __init__(
        self,
        cfg: Any,
        backend: Any,
        *,
        preferences: str | Path,
        epochs: int = 1,
        encoder: Any | None = None,
        **kwargs: Any,
    ):
        if cfg.algorithm.name not in OFFLINE_ALGORITHMS:
            raise ConfigError(
                f"key 'algorithm.name': --preferences trains {', '.join(OFFLINE_ALGORITHMS)}, "
                f"not {cfg.algorithm.name!r}"
            )
        if epochs < 1:
            raise ConfigError(f"--epochs must be >= 1, got {epochs}")
        source = PreferenceSource(
            read_preference_file(preferences), shuffle=cfg.data.shuffle, seed=cfg.data.seed
        )
        super().__init__(cfg, backend, replay=None, prompts=source, **kwargs)
        self.epochs = epochs
        self.encoder = encoder if encoder is not None else backend.adapter.sample_encoder()
        self.sampling = offline_sampling(cfg.sampling, seed=cfg.run.seed)
        self.pairs_fed = 0
        self.encode_s = 0.0
        log.info(
            "offline preferences: %d pairs from %s, %d epoch(s), %d pairs per step",
            len(source), source.file.path, epochs, cfg.train.groups_per_step,
        )  # fmt: skip

    def _lease_for(self, req: Any, now: float) -> Refusal:
        return Refusal(code="no_work", reason="an offline preference run issues no leases")

    def _used_up(self) -> bool:
        return self.prompts.peek_epoch() >= self.epochs

    def _feed(self) -> None:
        need = self.cfg.train.groups_per_step
        if self._future is not None or self.step >= self.cfg.max_steps:
            return
        if len(self.buffer) < need and not self._used_up():
            items = []
            while len(self.buffer) + len(items) < need and not self._used_up():
                spec, pair, _ = self.prompts.next()
                items.append((spec, pair))
            t0 = time.perf_counter()
            groups = preference_groups(
                items,
                self.encoder,
                self.sampling,
                policy_version=self.version,
                architecture=self.backend.architecture,
            )
            self.encode_s += time.perf_counter() - t0
            for group in groups:
                self._on_intake(encode(group))
            self.pairs_fed += len(items)
        if len(self.buffer) < need and self._used_up() and not self._stop_requested:
            log.info(
                "offline preferences: %d epoch(s) of %s done after %d pairs (%d left over, "
                "fewer than groups_per_step); stopping",
                self.epochs, self.prompts.file.path, self.pairs_fed, len(self.buffer),
            )  # fmt: skip
            self._stop_reason = f"{self.epochs} epoch(s) of the preference file done"
            self.request_stop()
