"""The rollout worker: leases in, sampled trajectory groups out, weight versions applied.

The loop thread owns every socket (zmq sockets are not thread-safe) and polls them:

- ``control`` (DEALER to the trainer's ROUTER): Hello -> Welcome, LeaseRequest -> Lease or
  Refusal, and a Heartbeat every ``heartbeat_interval_s`` listing the leases in hand;
- ``weights`` (DEALER to the trainer's weights ROUTER): WeightRequest -> WeightUpdate
  chunks, then every new version as the trainer publishes it;
- ``push`` (:class:`~omnirl.rollout.reward_push.RewardPush`: one PUSH connected to every
  reward worker; ZeroMQ round-robins among them);
- a monitor of ``control`` that tells when the trainer goes away and comes back.

The model lives in a :class:`~omnirl.rollout.sampler.SamplerThread`; heartbeats and weight
chunks keep flowing while it samples. A weight version is applied as a job of its own
between two lease jobs, never inside one, and only once all its chunks have arrived intact.
Before its first lease a worker holds the version the trainer serves it (late joiners
included), and before each lease it holds at least ``lease.policy_version``.

Exit codes: 0 after the trainer's ``shutdown`` or a stop request; 1 when the trainer
refuses us or the model cannot be built; 2 when the trainer has been unreachable for
``trainer_timeout_s``.
"""

from __future__ import annotations

import collections
import logging
import time
import uuid
from dataclasses import dataclass, field

import zmq

from omnirl.protocol.auth import SecurityConfig
from omnirl.protocol.codec import decode
from omnirl.protocol.errors import ProtocolError
from omnirl.protocol.messages import (
    Capabilities,
    Heartbeat,
    Hello,
    Lease,
    LeaseRequest,
    LeaseReturn,
    Refusal,
    WeightRequest,
    WeightUpdate,
    Welcome,
)
from omnirl.protocol.sockets import SocketFactory, SocketOptions, recv_ready, send_nowait
from omnirl.protocol.trainer_link import LINK_BACK, LINK_GONE, LINK_MOVED, TrainerLink
from omnirl.rollout.model import DEFAULT_FLOAT8_RECALIBRATE_EVERY, RolloutModel
from omnirl.rollout.reward_push import RewardPush
from omnirl.rollout.sampler import JobResult, SamplerThread
from omnirl.rollout.weights_inbox import WeightInbox

log = logging.getLogger("omnirl.rollout")

EXIT_OK, EXIT_FATAL, EXIT_TRAINER_LOST = 0, 1, 2


@dataclass(kw_only=True, slots=True)
class RolloutWorkerConfig:
    trainer: str = ""  # the trainer's control address, or:
    trainer_file: str = ""  # the trainer's address file, read again if the trainer moves
    device: str = "cpu"
    dtype: str = "float32"
    compile: bool = False  # the compiled backend (omnirl.models.compile), warmed up at build
    compile_mode: str | None = None  # torch.compile mode; "reduce-overhead": CUDA graphs
    compile_scope: str = "blocks"  # "blocks" | "whole" (omnirl.models.compile.COMPILE_SCOPES)
    compile_cache: str | None = None  # persistent compile cache directory (shared by workers)
    compile_decoder: bool = False  # with compile: the image decoder (VAE) compiled too
    float8: str | None = (
        None  # block linears in float8: "rowwise" | "static" (omnirl.models.float8)
    )
    float8_fast_accum: bool = False  # their matmuls' fast accumulation mode
    float8_fuse_projections: bool = False  # each attention's q, k, v as one float8 matmul
    # static float8 scales: calibrated again every N LoRA updates (0: never)
    float8_recalibrate_every: int = DEFAULT_FLOAT8_RECALIBRATE_EVERY
    lora_mode: str = "auto"  # "merged" | "adapter" | "auto" (merged in float32)
    decode_batch: int = 0  # images per VAE call (0: a lease's images in one call)
    worker_id: str = ""
    capacity: int = 1  # prompt groups per lease request
    security: SecurityConfig = field(default_factory=SecurityConfig)
    trainer_timeout_s: float = 30.0
    no_work_backoff_s: float = 0.2
    # the longest wait a refusal's retry_after_s buys: a trainer restarted meanwhile forgets
    max_retry_after_s: float = 30.0
    retry_s: float = 5.0  # resend an unanswered Hello / LeaseRequest / WeightRequest
    send_timeout_s: float = 30.0  # a group no reward worker takes in this long is dropped
    max_bytes: int = 1 << 31


@dataclass(slots=True)
class RolloutCounters:
    leases_done: int = 0
    leases_failed: int = 0
    leases_expired: int = 0  # deadline passed while waiting for weights
    groups_sent: int = 0
    groups_dropped: int = 0
    versions_applied: int = 0


class RolloutWorker:
    """Run with :meth:`run`; :meth:`stop` (any thread, or a signal handler) ends it."""

    def __init__(self, config: RolloutWorkerConfig, *, context: zmq.Context | None = None):
        self.config = config
        self.worker_id = config.worker_id or f"rollout-{uuid.uuid4().hex[:8]}"
        self.counters = RolloutCounters()
        self._context = context
        self._stop = False
        self._welcome: Welcome | None = None
        self._model: RolloutModel | None = None
        self._model_state = "none"  # none | loading | ready
        self._inbox = WeightInbox()
        self._held_version = -1
        self._held_digest = ""
        self._leases: collections.deque[Lease] = collections.deque()
        self._sampling: Lease | None = None
        self._lease_requested_at: float | None = None
        self._weights_requested_at = -1e9
        self._backoff_until = 0.0
        self._last_sample_s = 0.0

    def stop(self) -> None:
        self._stop = True

    # ------------------------------------------------------------------------------ loop

    def run(self) -> int:
        cfg = self.config
        self._sampler = SamplerThread()
        self._sockets = SocketFactory(
            cfg.security, SocketOptions(max_bytes=cfg.max_bytes), context=self._context
        )
        self._weights: zmq.Socket | None = None
        self._weights_address = ""
        self._rewards = RewardPush(
            self._sockets, worker_id=self.worker_id, send_timeout_s=cfg.send_timeout_s
        )
        self._poller = zmq.Poller()
        self._link = TrainerLink(
            self._sockets, self._poller, address=cfg.trainer, address_file=cfg.trainer_file or None
        )
        try:
            if not self._link.open(wait_s=cfg.trainer_timeout_s, stopped=lambda: self._stop):
                return EXIT_OK if self._stop else EXIT_TRAINER_LOST
            log.info(
                "%s: trainer %s, device %s, dtype %s",
                self.worker_id,
                self._link.source,
                cfg.device,
                cfg.dtype,
            )
            while not self._stop:
                now = time.monotonic()
                state = self._link.tend(
                    now,
                    welcome=self._welcome,
                    hello=self._hello,
                    heartbeat=self._heartbeat,
                    retry_s=cfg.retry_s,
                    timeout_s=cfg.trainer_timeout_s,
                    name=self.worker_id,
                )
                if state == LINK_GONE:
                    return EXIT_TRAINER_LOST
                if state == LINK_MOVED:
                    self._unwelcome()  # register with it
                    continue
                for sock, _ in self._poller.poll(timeout=50):
                    if sock is self._link.monitor:
                        if self._link.read_monitor(self.worker_id) == LINK_BACK:
                            self._unwelcome()
                    elif sock is self._link.control:
                        frames = recv_ready(self._link.control)  # None: a CURVE heartbeat woke it
                        code = None if frames is None else self._on_control(frames)
                        if code is not None:
                            return code
                    elif sock is self._weights:
                        frames = recv_ready(self._weights)
                        if frames is not None:
                            self._on_weights(frames)
                for result in self._sampler.poll():
                    code = self._on_result(result)
                    if code is not None:
                        return code
                self._advance()
            return EXIT_OK
        finally:
            self._sampler.close()
            self._link.close()
            self._sockets.close()

    def _advance(self) -> None:
        """Start whatever can start now: the model, a weight version, a lease, a request."""
        if self._welcome is None or self._sampler.busy:
            return
        now = time.monotonic()
        update = self._inbox.newest_above(self._held_version)
        if self._model_state == "none":
            # The model is built with the adapter shape the first version needs.
            if update is None:
                self._request_weights(now)
                return
            welcome, cfg = self._welcome, self.config
            self._model_state = "loading"
            self._sampler.submit(
                "load",
                lambda: RolloutModel.build(
                    welcome,
                    update,
                    device=cfg.device,
                    dtype=cfg.dtype,
                    compile=cfg.compile,
                    compile_mode=cfg.compile_mode,
                    compile_scope=cfg.compile_scope,
                    compile_cache=cfg.compile_cache,
                    compile_decoder=cfg.compile_decoder,
                    float8=cfg.float8,
                    float8_fast_accum=cfg.float8_fast_accum,
                    float8_fuse_projections=cfg.float8_fuse_projections,
                    float8_recalibrate_every=cfg.float8_recalibrate_every,
                    lora_mode=cfg.lora_mode,
                    capacity=cfg.capacity,
                    decode_batch=cfg.decode_batch,
                ),
            )
            return
        if update is not None:
            self._sampler.submit("apply", lambda: self._model.apply(update), ref=update)
            return
        if self._leases:
            lease = self._leases[0]
            if self._held_version >= lease.policy_version:
                self._leases.popleft()
                self._sampling = lease
                version = self._held_version
                self._sampler.submit(
                    "lease", lambda: self._model.sample(lease, self.worker_id, version), ref=lease
                )
                return
            if time.time() > lease.deadline:
                self._leases.popleft()
                self.counters.leases_expired += 1
                log.warning(
                    "%s: lease %s expired waiting for version %d (hold %d)",
                    self.worker_id,
                    lease.lease_id,
                    lease.policy_version,
                    self._held_version,
                )
                return
            self._request_weights(now)
            return
        if self._held_version < 0:  # a version is held before the first lease is asked for
            self._request_weights(now)
            return
        if not self._rewards.addresses:
            return  # nowhere to send groups yet; a later Welcome or Lease names a reward worker
        if (
            self._lease_requested_at is not None
            and now - self._lease_requested_at < self.config.retry_s
        ):
            return
        if now < self._backoff_until:
            return
        send_nowait(
            self._link.control,
            LeaseRequest(worker_id=self.worker_id, capacity=self.config.capacity),
        )
        self._lease_requested_at = now

    def _request_weights(self, now: float) -> None:
        if self._weights is not None and now - self._weights_requested_at >= self.config.retry_s:
            have = self._held_version
            send_nowait(self._weights, WeightRequest(worker_id=self.worker_id, have_version=have))
            self._weights_requested_at = now

    # -------------------------------------------------------------------------- messages

    def _on_control(self, frames: list) -> int | None:
        try:
            msg = decode(frames, max_bytes=self.config.max_bytes)
        except ProtocolError as exc:
            log.warning("%s: malformed control message: %s", self.worker_id, exc)
            return None
        if isinstance(msg, Welcome):
            return self._on_welcome(msg)
        if isinstance(msg, Lease):
            self._lease_requested_at = None
            if msg.reward_address:
                self._rewards.connect([msg.reward_address])
            self._leases.append(msg)
            log.info(
                "%s: lease %s: groups %s (version >= %d)",
                self.worker_id,
                msg.lease_id,
                " ".join(p.group_id for p in msg.prompts),
                msg.policy_version,
            )
            return None
        if isinstance(msg, Refusal):
            if msg.code == "no_work":
                self._lease_requested_at = None
                wait = self.config.no_work_backoff_s
                if msg.retry_after_s > 0:  # benched: asking sooner is refused too
                    wait = max(wait, min(msg.retry_after_s, self.config.max_retry_after_s))
                    log.warning("%s: no leases for %.0f s: %s", self.worker_id, wait, msg.reason)
                self._backoff_until = time.monotonic() + wait
            elif msg.code == "shutdown":
                log.info("%s: trainer shut down: %s", self.worker_id, msg.reason)
                return EXIT_OK
            elif msg.code in ("unknown_worker", "not_registered"):
                log.info(
                    "%s: trainer does not know us (%s), registering again",
                    self.worker_id,
                    msg.reason,
                )
                self._unwelcome()
            elif self._welcome is None:
                log.error(
                    "%s: trainer refused registration (%s): %s",
                    self.worker_id,
                    msg.code,
                    msg.reason,
                )
                return EXIT_FATAL
            else:
                self._lease_requested_at = None
                self._backoff_until = time.monotonic() + self.config.no_work_backoff_s
                log.warning("%s: refusal %s: %s", self.worker_id, msg.code, msg.reason)
        return None

    def _on_welcome(self, msg: Welcome) -> int | None:
        if msg.policy_version < self._held_version:  # a trainer resumed from an older state
            self._held_version = -1
        self._welcome = msg
        log.info(
            "%s: welcomed to run %s at version %d (model %s, %s)",
            self.worker_id,
            msg.run_id,
            msg.policy_version,
            msg.model_path,
            msg.architecture,
        )
        if msg.topology.weights != self._weights_address:
            if self._weights is not None:
                self._poller.unregister(self._weights)
                self._weights.close(linger=0)
            self._weights = self._sockets.connect("weights", msg.topology.weights)
            self._weights_address = msg.topology.weights
            self._poller.register(self._weights, zmq.POLLIN)
            self._inbox.reset()
        self._rewards.connect(msg.topology.reward)
        self._weights_requested_at = -1e9
        self._request_weights(time.monotonic())  # also introduces us to the weights socket
        return None

    def _on_weights(self, frames: list) -> None:
        try:
            msg = decode(frames, max_bytes=self.config.max_bytes)
        except ProtocolError as exc:
            log.warning("%s: malformed weights message: %s", self.worker_id, exc)
            return
        if isinstance(msg, WeightUpdate):
            done = self._inbox.add(msg)
            if done is not None:
                log.info(
                    "%s: received version %d whole (%s, %d tensors)",
                    self.worker_id,
                    done.version,
                    done.format,
                    len(done.tensors),
                )
        elif isinstance(msg, Refusal):
            log.warning("%s: weights refusal %s: %s", self.worker_id, msg.code, msg.reason)

    def _on_result(self, result: JobResult) -> int | None:
        if result.kind == "load":
            if not result.ok:
                log.error("%s: cannot build the rollout model: %s", self.worker_id, result.error)
                return EXIT_FATAL
            self._model = result.value
            self._model_state = "ready"
            log.info("%s: model ready in %.1f s", self.worker_id, result.seconds)
        elif result.kind == "apply":
            update = result.ref
            if result.ok:
                self._held_version, self._held_digest = update.version, update.digest
                self.counters.versions_applied += 1
                log.info(
                    "%s: applied weights version=%d format=%s digest=%s in %.3f s",
                    self.worker_id,
                    update.version,
                    update.format,
                    update.digest,
                    result.seconds,
                )
            else:
                log.error(
                    "%s: version %d could not be applied: %s",
                    self.worker_id,
                    update.version,
                    result.error,
                )
            self._inbox.discard_through(update.version)
        elif result.kind == "lease":
            lease: Lease = result.ref
            self._sampling = None
            if not result.ok:
                self.counters.leases_failed += 1
                self._backoff_until = time.monotonic() + 1.0
                # the trainer issues its groups again now, not at the lease's deadline (or, for
                # sampling parameters the model refuses, ends the run: no worker can sample it)
                send_nowait(
                    self._link.control,
                    LeaseReturn(
                        lease_id=lease.lease_id,
                        worker_id=self.worker_id,
                        reason=result.error,
                        bad_sampling=result.bad_sampling,
                    ),
                )
                return None
            self._last_sample_s = result.seconds
            for group in result.value:
                if self._rewards.send(group, result.seconds / max(1, len(result.value))):
                    self.counters.groups_sent += 1
                else:
                    self.counters.groups_dropped += 1
            self.counters.leases_done += 1
            peak = self._model.peak_memory if self._model is not None else {}
            log.info(
                "%s: lease %s done at version %d in %.2f s%s",
                self.worker_id,
                lease.lease_id,
                self._held_version,
                result.seconds,
                f" (device memory peak {peak['allocated']:.2f} GB allocated, "
                f"{peak['reserved']:.2f} GB reserved)"
                if peak
                else "",
            )
        return None

    def _unwelcome(self) -> None:
        """Forget the registration and the lease asked for (register again); the link's
        trainer-lost clock counts from now."""
        self._welcome = None
        self._lease_requested_at = None
        self._link.unwelcome()

    def _hello(self) -> Hello:
        backend = "compiled" if self.config.compile else "diffusers"
        caps = Capabilities(backends=[backend], device=self.config.device)
        return Hello(role="rollout", worker_id=self.worker_id, capabilities=caps)

    def _heartbeat(self) -> Heartbeat:
        c = self.counters
        leases = [lease.lease_id for lease in self._leases]
        if self._sampling is not None:
            leases.append(self._sampling.lease_id)
        return Heartbeat(
            worker_id=self.worker_id,
            role="rollout",
            policy_version=self._held_version,
            leases=leases,
            time=time.time(),
            stats={
                "weights_version": float(self._held_version),
                "weights_digest": float(int(self._held_digest[:12], 16))
                if self._held_digest
                else -1.0,
                "leases_done": float(c.leases_done),
                "leases_failed": float(c.leases_failed),
                "groups_sent": float(c.groups_sent),
                "groups_dropped": float(c.groups_dropped),
                "versions_applied": float(c.versions_applied),
                "last_sample_s": self._last_sample_s,
            },
        )
