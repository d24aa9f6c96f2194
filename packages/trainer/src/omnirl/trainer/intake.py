"""The trainer's intake: scored trajectory groups in, validated and counted exactly once.

:meth:`Intake.receive` takes the frames of one message from the intake PULL socket,
decodes them (size-limited, finite-checked by the codec), checks that the group is scored
and self-consistent, and asks the :class:`~omnirl.trainer.ledger.Ledger` what it counts as.
Nothing it receives can raise out of it: a bad message is logged with a reason and
counted under ``intake_rejected[reason]``.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from typing import Any

from omnirl.protocol.messages import (
    DiffusionTrajectoryGroup,
    Refusal,
    TokenTrajectoryGroup,
)
from omnirl.trainer.ledger import Accepted, Ledger, Outcome

log = logging.getLogger(__name__)

Group = DiffusionTrajectoryGroup | TokenTrajectoryGroup


class RateMeter:
    """Events per second over a sliding window (seconds)."""

    def __init__(self, window_s: float = 10.0):
        self.window_s = window_s
        self._times: deque[float] = deque()

    def tick(self, now: float, n: int = 1) -> None:
        self._times.extend([now] * n)
        self._trim(now)

    def _trim(self, now: float) -> None:
        while self._times and now - self._times[0] > self.window_s:
            self._times.popleft()

    def rate(self, now: float) -> float:
        self._trim(now)
        if not self._times:
            return 0.0
        span = max(now - self._times[0], 1e-3)
        return len(self._times) / max(span, min(self.window_s, 1.0))


def _group_problem(msg: Group) -> str | None:
    """Why a decoded group cannot be trained on, or None."""
    if msg.rewards is None:
        return "unscored"
    if msg.rewards.group_id and msg.rewards.group_id != msg.group_id:
        return "rewards_group_id_mismatch"
    g = msg.sampling.group_size
    if len(msg.rewards.total) != g:
        return "rewards_length_mismatch"
    if isinstance(msg, DiffusionTrajectoryGroup):
        if tuple(msg.seeds.shape) != (g,):
            return "seeds_shape_mismatch"
        if msg.log_probs is not None and msg.log_probs.shape[0] != g:
            return "log_probs_shape_mismatch"
    elif msg.response_ids.shape[0] != g:
        return "response_shape_mismatch"
    return None


class Intake:
    def __init__(self, ledger: Ledger, *, max_bytes: int):
        self.ledger = ledger
        self.max_bytes = max_bytes
        self.rejected: Counter[str] = Counter()
        self.outcomes: Counter[str] = Counter()
        self.meter = RateMeter()
        self.received = 0

    def receive(
        self, frames: list[Any], current_version: int
    ) -> tuple[Group | None, Outcome | None]:
        """Returns ``(group, outcome)``; ``group`` is set only when it was accepted."""
        from omnirl.protocol.codec import decode

        self.received += 1
        try:
            msg = decode(frames, max_bytes=self.max_bytes)
        except Exception as err:  # every decode failure is a rejected message, never a crash
            reason = type(err).__name__
            self.rejected[reason] += 1
            log.warning("intake: rejected undecodable message (%s): %s", reason, err)
            return None, None
        if isinstance(msg, Refusal):
            self.rejected[f"refusal:{msg.code}"] += 1
            log.warning("intake: a worker reported %s: %s (%s)", msg.code, msg.reason, msg.ref)
            return None, None
        if not isinstance(msg, DiffusionTrajectoryGroup | TokenTrajectoryGroup):
            self.rejected["unexpected_kind"] += 1
            log.warning("intake: rejected a %s message (only scored groups)", type(msg).__name__)
            return None, None
        problem = _group_problem(msg)
        if problem is not None:
            self.rejected[problem] += 1
            log.warning("intake: rejected group %s: %s", msg.group_id, problem)
            return None, None
        outcome = self.ledger.accept(
            msg.group_id, msg.lease_id, msg.policy_version, current_version
        )
        self.outcomes[type(outcome).__name__] += 1
        if isinstance(outcome, Accepted):
            self.meter.tick(time.monotonic())
            return msg, outcome
        log.info("intake: group %s not used: %s", msg.group_id, outcome)
        return None, outcome

    def rate(self) -> float:
        return self.meter.rate(time.monotonic())

    def summary(self) -> dict[str, Any]:
        return {
            "received": self.received,
            "rate_per_s": self.rate(),
            "outcomes": dict(self.outcomes),
            "rejected": dict(self.rejected),
        }
