"""The reward worker: PULL trajectory groups, score their images, PUSH them to the trainer.

One thread, one poller: the PULL it binds (its address goes in its ``Hello``), the control
DEALER to the trainer, and a monitor of that DEALER that tells when the trainer goes away.
A group is decoded without the finiteness scan of its large tensors (the trainer does that
on intake) and only its ``images`` are read; the other tensor frames are forwarded as the
very buffers that arrived (the codec builds tensors over received frames and encodes a
contiguous tensor as a view of its memory, so nothing is copied or re-encoded but the header).

Exit codes: 0 after the trainer's ``shutdown`` or a stop request; 1 when the trainer refuses
us; 2 when the trainer has been unreachable for ``trainer_timeout_s``.
"""

from __future__ import annotations

import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import zmq

from omnirl.protocol.auth import SecurityConfig
from omnirl.protocol.codec import decode, encode
from omnirl.protocol.errors import ProtocolError
from omnirl.protocol.messages import (
    DiffusionTrajectoryGroup,
    Heartbeat,
    Hello,
    Refusal,
    Welcome,
)
from omnirl.protocol.sockets import (
    SocketFactory,
    SocketOptions,
    advertised_endpoint,
    bound_endpoint,
    recv_ready,
)
from omnirl.protocol.trainer_link import LINK_BACK, LINK_GONE, LINK_MOVED, TrainerLink
from omnirl.reward.scorers import UnknownScorer
from omnirl.reward.scoring import (
    ScorerSpecError,
    ScoringError,
    WeightedScorer,
    parse_scorer_spec,
    score_groups,
)

log = logging.getLogger("omnirl.reward")

EXIT_OK, EXIT_REFUSED, EXIT_TRAINER_LOST = 0, 1, 2
DEFAULT_SCORER = "jpeg_compressibility"  # a Welcome from a trainer that names none


@dataclass(kw_only=True, slots=True)
class RewardWorkerConfig:
    trainer: str = ""  # the trainer's control address, or:
    trainer_file: str = ""  # the trainer's address file, read again if the trainer moves
    scorers: list[WeightedScorer] | None = None  # None: the run's (Welcome config reward.scorer)
    bind: str = "tcp://127.0.0.1:0"
    # the host rollout workers on other machines reach the PULL at (e.g. the pod's IP);
    # default: the bound host, or this machine's host name for a wildcard bind
    advertise: str = ""
    worker_id: str = ""
    security: SecurityConfig = field(default_factory=SecurityConfig)
    trainer_timeout_s: float = 30.0
    max_bytes: int = 1 << 31
    hello_retry_s: float = 5.0
    send_timeout_s: float = 10.0
    batch_groups: int = 1  # score up to this many already-queued groups in one batch
    score_threads: int = 1  # thread pool for rewards that declare thread_safe


@dataclass(slots=True)
class RewardCounters:
    scored: int = 0
    refused: int = 0  # sent on as a Refusal (scorer failure, no images, wrong kind)
    malformed: int = 0  # could not be decoded: dropped, logged
    dropped: int = 0  # scored, but the intake did not take it in send_timeout_s
    revoked: int = 0  # from a CURVE key removed from the allow-list: dropped, logged


class RewardWorker:
    """Run with :meth:`run`; :meth:`stop` (any thread, or a signal handler) ends it."""

    def __init__(self, config: RewardWorkerConfig, *, context: zmq.Context | None = None):
        self.config = config
        self.worker_id = config.worker_id or f"reward-{uuid.uuid4().hex[:8]}"
        self.counters = RewardCounters()
        self.address = ""  # the PULL's bound address, known once run() has started
        self._context = context
        self._stop = False
        self._welcome: Welcome | None = None
        self._pool: ThreadPoolExecutor | None = None
        self.scorers = config.scorers

    def stop(self) -> None:
        self._stop = True

    # ------------------------------------------------------------------------------ loop

    def _drop_revoked(self, sockets: SocketFactory, batch: list[list]) -> list[list]:
        """``batch`` without the groups of CURVE keys revoked since their connection was made
        (counted)."""
        kept = [frames for frames in batch if sockets.revoked_sender(frames) is None]
        self.counters.revoked += len(batch) - len(kept)
        return kept

    def run(self) -> int:
        cfg = self.config
        _preload_torch()  # decoding a group's tensors needs torch: import it before we register
        sockets = SocketFactory(
            cfg.security, SocketOptions(max_bytes=cfg.max_bytes), context=self._context
        )
        pull = sockets.bind("reward", cfg.bind)
        self.address = advertised_endpoint(bound_endpoint(pull), cfg.advertise)
        poller = zmq.Poller()
        poller.register(pull, zmq.POLLIN)
        self._link = link = TrainerLink(
            sockets, poller, address=cfg.trainer, address_file=cfg.trainer_file or None
        )
        push: zmq.Socket | None = None
        push_address = ""
        try:
            if not link.open(wait_s=cfg.trainer_timeout_s, stopped=lambda: self._stop):
                return EXIT_OK if self._stop else EXIT_TRAINER_LOST
            log.info("%s: PULL on %s, trainer %s", self.worker_id, self.address, link.source)
            while not self._stop:
                now = time.monotonic()
                control, monitor = link.control, link.monitor
                state = link.tend(
                    now,
                    welcome=self._welcome,
                    hello=self._hello,
                    heartbeat=self._heartbeat,
                    retry_s=cfg.hello_retry_s,
                    timeout_s=cfg.trainer_timeout_s,
                    name=self.worker_id,
                )
                if state == LINK_GONE:
                    return EXIT_TRAINER_LOST
                if state == LINK_MOVED:
                    self._unwelcome()  # register with it
                    continue
                for sock, _ in poller.poll(timeout=200):
                    if sock is monitor:
                        if link.read_monitor(self.worker_id) == LINK_BACK:
                            self._unwelcome()
                    elif sock is control:
                        frames = recv_ready(control)
                        if frames is None:  # a CURVE heartbeat woke the poll
                            continue
                        code = self._on_control(frames)
                        if code is not None:
                            return code
                        intake = self._welcome.topology.intake if self._welcome else ""
                        if intake and intake != push_address:
                            if push is not None:
                                push.close(linger=1000)
                            push = sockets.connect("intake", intake)
                            push.setsockopt(zmq.SNDTIMEO, int(cfg.send_timeout_s * 1000))
                            push_address = intake
                    elif sock is pull:
                        first = recv_ready(pull)
                        if first is None:  # a CURVE heartbeat woke the poll
                            continue
                        batch = [first]
                        while len(batch) < cfg.batch_groups:  # what is queued already
                            try:
                                batch.append(pull.recv_multipart(zmq.NOBLOCK, copy=False))
                            except zmq.Again:
                                break
                        batch = self._drop_revoked(sockets, batch)
                        if not batch:
                            continue
                        if push is None:
                            self.counters.malformed += len(batch)
                            log.warning("%s: group before welcome, dropped", self.worker_id)
                            continue
                        for out in self.process_batch(batch):
                            try:
                                push.send_multipart(out, copy=False)
                            except zmq.Again:  # the trainer's intake is away or full
                                self.counters.dropped += 1
                                log.warning(
                                    "%s: intake did not take a message in %.0f s; "
                                    "dropped (its lease will be reissued)",
                                    self.worker_id,
                                    cfg.send_timeout_s,
                                )
            return EXIT_OK
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=False)
            link.close()
            sockets.close()

    # -------------------------------------------------------------------------- messages

    def process(self, frames: list) -> list[list]:
        """Score one received multipart message; return the messages to forward (0 or 1)."""
        return self.process_batch([frames])

    def process_batch(self, messages: list[list]) -> list[list]:
        """Score received multipart messages together; return the messages to forward.

        A message that cannot be decoded is dropped and counted; a group that cannot be
        scored becomes a ``Refusal(code="reward_failed", ref=group_id)`` on the intake, the
        other groups of the batch are scored as usual. Rewards see the samples of all groups
        at once (``batchable``), split over ``score_threads`` (``thread_safe``).
        """
        t0 = time.perf_counter()
        forwards: list[list] = []
        groups: list[DiffusionTrajectoryGroup] = []
        for frames in messages:
            try:
                msg = decode(frames, max_bytes=self.config.max_bytes, check_finite=False)
            except ProtocolError as exc:
                self.counters.malformed += 1
                log.warning("%s: dropped a malformed message: %s", self.worker_id, exc)
                continue
            if not isinstance(msg, DiffusionTrajectoryGroup):
                self.counters.refused += 1
                reason = (
                    f"reward worker {self.worker_id} scores diffusion groups, "
                    f"got {type(msg).__name__}"
                )
                log.warning("%s: %s", self.worker_id, reason)
                ref = getattr(msg, "group_id", "")
                forwards.append(encode(Refusal(code="unsupported", reason=reason, ref=ref)))
                continue
            groups.append(msg)
        if self._pool is None and self.config.score_threads > 1:
            self._pool = ThreadPoolExecutor(self.config.score_threads, thread_name_prefix="score")
        results = score_groups(
            groups,
            self.scorers,
            scorer_id=self.worker_id,
            pool=self._pool,
            workers=self.config.score_threads,
        )
        elapsed = time.perf_counter() - t0
        for msg, result in zip(groups, results, strict=True):
            if isinstance(result, ScoringError):
                self.counters.refused += 1
                log.warning("%s: %s (lease %s)", self.worker_id, result, msg.lease_id)
                reason = f"{result} (lease {msg.lease_id}, worker {msg.worker_id})"
                forwards.append(
                    encode(Refusal(code="reward_failed", reason=reason, ref=msg.group_id))
                )
                continue
            msg.rewards = result
            msg.timings = {**msg.timings, "reward_s": elapsed}
            self.counters.scored += 1
            # The large tensors were not read; the trainer checks their finiteness on intake.
            forwards.append(encode(msg, check_finite=False))
        return forwards

    def _on_control(self, frames: list) -> int | None:
        try:
            msg = decode(frames, max_bytes=1 << 24)
        except ProtocolError as exc:
            log.warning("%s: malformed control message: %s", self.worker_id, exc)
            return None
        if isinstance(msg, Welcome):
            if self.scorers is None:
                spec = (msg.config.get("reward") or {}).get("scorer") or DEFAULT_SCORER
                try:
                    self.scorers = parse_scorer_spec(spec)
                except (UnknownScorer, ScorerSpecError, ValueError) as exc:
                    log.error("%s: the run's reward.scorer %r: %s", self.worker_id, spec, exc)
                    return EXIT_REFUSED
                log.info("%s: scoring with the run's reward.scorer %r", self.worker_id, spec)
            if self._welcome is None:
                log.info(
                    "%s: welcomed to run %s, intake %s",
                    self.worker_id,
                    msg.run_id,
                    msg.topology.intake,
                )
            self._welcome = msg
        elif isinstance(msg, Refusal):
            if msg.code == "shutdown":
                log.info("%s: trainer shut down: %s", self.worker_id, msg.reason)
                return EXIT_OK
            if msg.code in ("unknown_worker", "not_registered"):
                self._unwelcome()
            elif self._welcome is None:
                log.error(
                    "%s: trainer refused registration (%s): %s",
                    self.worker_id,
                    msg.code,
                    msg.reason,
                )
                return EXIT_REFUSED
            else:
                log.warning("%s: refusal %s: %s", self.worker_id, msg.code, msg.reason)
        return None

    def _unwelcome(self) -> None:
        """Forget the registration (register again); the link's trainer-lost clock counts
        from now."""
        self._welcome = None
        self._link.unwelcome()

    def _hello(self) -> Hello:
        return Hello(role="reward", worker_id=self.worker_id, address=self.address)

    def _heartbeat(self) -> Heartbeat:
        c = self.counters
        return Heartbeat(
            worker_id=self.worker_id,
            role="reward",
            time=time.time(),
            stats={
                "scored": float(c.scored),
                "refused": float(c.refused),
                "malformed": float(c.malformed),
                "dropped": float(c.dropped),
            },
        )


def _preload_torch() -> None:
    """Import torch now: a first import inside the loop can stall heartbeats for many seconds."""
    import torch  # noqa: F401  (the reward package depends on torch)
