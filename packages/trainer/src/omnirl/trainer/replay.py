"""``trainer --replay DIR``: train straight from a recording of an intake stream, no workers.

:class:`ReplayTrainerServer` is the ordinary :class:`~omnirl.trainer.server.TrainerServer`
with one more source of intake frames: before each chance to start a step it feeds
recorded messages through the same intake path the socket uses (``_on_intake``), one at a
time, until ``groups_per_step`` groups are buffered. Nothing is fed while a step runs, so
the batches and the policy version each group meets depend only on the recording and the
config: the same recording, seed and config give the same losses and weights (on a CPU;
see docs/recording.md for GPUs).

The recorded groups were leased by another run's ledger, so each one is first entered in
this run's ledger as leased to a worker called ``replay`` (a group recorded twice is still
counted once). When the recording is used up, the run stops as if asked to. With
``trainer --admit-unleased`` the same admission applies to groups arriving on the intake
socket, which is how ``uv run replay DIR --trainer ADDR`` feeds a running trainer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from omnirl.protocol.codec import decode
from omnirl.protocol.messages import DiffusionTrajectoryGroup, TokenTrajectoryGroup
from omnirl.protocol.recording import RecordingReader
from omnirl.trainer.server import TrainerServer

log = logging.getLogger("omnirl.trainer")

REPLAY_WORKER = "replay"


class ReplayTrainerServer(TrainerServer):
    """``replay``: a recording to train from; None: only admit groups from the intake socket
    that this run did not lease (``trainer --admit-unleased``, for the ``replay`` tool)."""

    def __init__(self, cfg: Any, backend: Any, *, replay: str | Path | None, **kwargs: Any):
        super().__init__(cfg, backend, **kwargs)
        self.reader = RecordingReader(replay) if replay is not None else None
        self._records: Iterator[Any] | None = self.reader.records() if self.reader else None
        self.replayed = 0

    def _maybe_start_step(self) -> None:
        self._feed()
        super()._maybe_start_step()

    def _on_intake(self, frames: list) -> None:
        self._enter_in_ledger(frames)
        super()._on_intake(frames)

    def _feed(self) -> None:
        need = self.cfg.train.groups_per_step
        while self._records is not None and self._future is None and len(self.buffer) < need:
            if self.step >= self.cfg.max_steps:
                return
            record = next(self._records, None)
            if record is None:
                self._records = None
                log.info(
                    "replay: recording %s used up after %d messages (%s); stopping",
                    self.reader.directory, self.replayed, self.reader.stats,
                )  # fmt: skip
                self.request_stop()
                return
            self.replayed += 1
            self._on_intake(record.frames)

    def _enter_in_ledger(self, frames: list[Any]) -> None:
        """Make a recorded group known to this run's ledger, as if leased here just now."""
        try:
            msg = decode(frames, max_bytes=self.cfg.runtime.max_message_bytes, check_finite=False)
        except Exception:
            return  # the intake rejects and counts it
        if not isinstance(msg, DiffusionTrajectoryGroup | TokenTrajectoryGroup):
            return
        if msg.prompt.group_id in self.ledger.groups:
            return  # a repeat: the ledger counts it as a duplicate
        self.ledger.issue(
            REPLAY_WORKER,
            1,
            time.time(),
            policy_version=msg.policy_version,
            fresh=lambda: msg.prompt,
        )
