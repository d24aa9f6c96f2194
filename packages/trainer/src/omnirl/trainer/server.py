"""The trainer process: sockets, the conversation with the fleet, and the training loop.

One thread owns every socket and the ledger (zmq sockets are not thread-safe); the
optimisation step runs on a second thread so that leases, heartbeats, weight requests
and intake keep being served while it trains. Per loop iteration:

1. poll ``control`` (ROUTER), ``weights`` (ROUTER) and ``intake`` (PULL); answer each
   message (see docs/architecture.md, "The conversation");
2. expire leases past their deadline or held by workers that stopped heartbeating;
3. when a step has finished: mark its groups trained, publish version v+1 to every rollout
   worker, log metrics, checkpoint when due;
4. when no step is running and ``groups_per_step`` accepted groups are buffered: start one.

The conversation on ``control`` is :class:`~omnirl.trainer.fleet.FleetControl`'s, the
steps' start, finish and failure :class:`~omnirl.trainer.step_cycle.StepCycle`'s (both
mixed into the server).

After ``max_steps`` the server stops leasing, answers every request with
``Refusal(code="shutdown")`` for ``runtime.shutdown_grace_s`` so that each live worker
hears it once, writes a final checkpoint and returns 0.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import zmq

from omnirl.protocol.auth import SecurityConfig
from omnirl.protocol.codec import decode, encode
from omnirl.protocol.errors import ProtocolError
from omnirl.protocol.messages import (
    Message,
    Refusal,
    WeightRequest,
)
from omnirl.protocol.trainer_link import ADDRESS_FILE
from omnirl.trainer.balanced_data import BalancedPromptSource
from omnirl.trainer.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    set_rng_state,
)
from omnirl.trainer.config import checkpoint_dir
from omnirl.trainer.data import PromptSource
from omnirl.trainer.fleet import FleetControl
from omnirl.trainer.intake import Intake
from omnirl.trainer.ledger import Ledger
from omnirl.trainer.publisher import WeightPublisher
from omnirl.trainer.step_cycle import StepCycle

log = logging.getLogger("omnirl.trainer")

INTAKE_BURST = 512  # intake messages handled per loop iteration before serving control again


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


class TrainerServer(FleetControl, StepCycle):
    """Run with :meth:`run`; ``backend`` is what trains (see :mod:`omnirl.trainer.backend`)."""

    def __init__(
        self,
        cfg: Any,
        backend: Any,
        *,
        resume: bool = False,
        context: zmq.Context | None = None,
        intake_tap: Callable[[list[Any]], None] | None = None,
        prompts: Any | None = None,
    ):
        """``intake_tap(frames)`` sees every raw intake message before it is decoded (the
        hook a recorder attaches to); an exception in it is logged, never fatal. ``prompts``
        replaces the prompt source of ``data.prompts`` (same ``next`` / ``state_dict`` /
        ``load_state_dict``, and ``observe(prompt, rewards)`` if it adapts to the rewards;
        the offline preference mode passes its pairs)."""
        self.cfg = cfg
        self.intake_tap = intake_tap
        self.backend = backend
        self.run_id = cfg.run.name
        rt = cfg.runtime
        self.ledger = Ledger(
            groups_per_step=cfg.train.groups_per_step,
            max_staleness=cfg.train.max_staleness,
            lease_timeout_s=rt.lease_timeout_s,
            heartbeat_timeout_s=rt.heartbeat_timeout_s,
            max_reissues=rt.max_reissues,
            worker_failure_limit=rt.worker_failure_limit,
            bench_s=rt.bench_s,
            run_id=self.run_id,
        )
        if prompts is None:
            source = BalancedPromptSource if cfg.data.balance_by else PromptSource
            prompts = source.from_config(cfg.data)
        self.prompts = prompts
        self._observe_rewards = getattr(prompts, "observe", None)
        self.intake = Intake(self.ledger, max_bytes=rt.max_message_bytes)
        self.publisher = WeightPublisher(
            chunk_bytes=rt.weight_chunk_bytes,
            format=backend.weight_format,
            adapter_config=backend.adapter_config,
        )
        self.version = 0
        self.step = 0
        self.buffer: list[Any] = []
        self.counters: dict[str, int] = {"control_rejected": 0, "weights_rejected": 0}
        self._init_fleet(cfg)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="train-step")
        self._future: Future | None = None
        self._shutdown_at: float | None = None
        self._stop_requested = False
        self._stop_reason = "stop requested"
        self._started = time.monotonic()
        self._elapsed_before_s = 0.0  # the run's time in earlier processes (from --resume)
        # a step made the policy non-finite, or failed and could not be undone: no final
        # checkpoint of those weights
        self._diverged = False
        self._failures_in_a_row = 0
        # 1: stopped on repeated step failures, one that could not be undone, or a
        # non-finite policy
        self.exit_code = 0
        self._ctx = context or zmq.Context.instance()
        self.addresses: dict[str, str] = {}
        self.output_dir = Path(cfg.run.output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        if resume:
            self._resume()

    # ---------------------------------------------------------------------------- setup
    def _resume(self) -> None:
        path = latest_checkpoint(checkpoint_dir(self.cfg))
        if path is None:
            log.warning(
                "--resume: no checkpoint under %s, starting fresh", checkpoint_dir(self.cfg)
            )
            return
        loader = getattr(self.backend, "load_checkpoint", None)
        if loader is not None:  # every rank of a torchrun trainer loads it (LeaderBackend)
            ck = loader(path)
        else:
            ck = load_checkpoint(
                path, adapter=self.backend.adapter, train_step=self.backend.train_step
            )
        self.version = int(ck.state["version"])
        self.step = ck.step
        self._elapsed_before_s = float(ck.state.get("elapsed_s", 0.0))
        self.prompts.load_state_dict(ck.state["data"])
        self.ledger.load_state_dict(ck.state["ledger"])
        set_rng_state(ck.state["rng"])
        log.info("resumed from %s: step %d, version %d", path, self.step, self.version)

    def _open(self) -> None:
        from omnirl.protocol.sockets import (
            SocketFactory,
            SocketOptions,
            advertised_endpoint,
            bound_endpoint,
        )

        rt = self.cfg.runtime
        security = SecurityConfig(
            keys_dir=Path(rt.keys_dir) if rt.keys_dir else None,
            name=rt.key_name,
            insecure=rt.insecure,
        )
        options = SocketOptions(max_bytes=int(rt.max_message_bytes), linger_ms=0)
        self.sockets = SocketFactory(security, options, context=self._ctx)
        opened = {}
        # Options differ per role, and libzmq copies a socket's options into its listener
        # at bind time, so each socket is bound under its own options.
        per_role = {
            "control": options,
            # a full push is many chunks per peer: never block or drop on the HWM
            "weights": dataclasses.replace(options, hwm=0),
            # No ZMTP heartbeats on the stream: when senders outpace the trainer the pipe sits
            # at its HWM, libzmq stops reading the connection, misses the heartbeat and drops
            # the connection with the groups in flight (libzmq #3937, #4767). Reward workers'
            # liveness comes from their Heartbeat messages on control instead.
            "intake": dataclasses.replace(options, heartbeat_ivl_ms=0, heartbeat_timeout_ms=0),
        }
        for role, port in (
            ("control", rt.control_port),
            ("weights", rt.weights_port),
            ("intake", rt.intake_port),
        ):
            self.sockets.options = per_role[role]
            sock = self.sockets.bind(role, f"tcp://{rt.host}:{port or '*'}")
            opened[role] = sock
            self.addresses[role] = advertised_endpoint(bound_endpoint(sock), rt.advertise_host)
        self.sockets.options = options
        self.control, self.weights, self.intake_sock = (
            opened["control"],
            opened["weights"],
            opened["intake"],
        )
        self.poller = zmq.Poller()
        for sock in opened.values():
            self.poller.register(sock, zmq.POLLIN)

    def _close(self) -> None:
        self.sockets.close()
        self._executor.shutdown(wait=True)

    # ----------------------------------------------------------------------------- loop
    def run(self) -> int:
        from omnirl.trainer.metrics import MetricsLogger

        self._open()
        self.metrics = MetricsLogger(
            self.output_dir, self.cfg.logging, max_steps=self.cfg.max_steps, start_step=self.step
        )
        try:
            self.publisher.prepare(self.version, self.backend.export_weights())
            _atomic_write(self.output_dir / ADDRESS_FILE, self.addresses["control"] + "\n")
            log.info(
                "trainer %s listening: control %s, weights %s, intake %s (version %d, step %d/%d)",
                self.run_id, self.addresses["control"], self.addresses["weights"],
                self.addresses["intake"], self.version, self.step, self.cfg.max_steps,
            )  # fmt: skip
            next_expire = 0.0
            self._started = time.monotonic()
            budget_s = 60.0 * self.cfg.max_minutes
            while True:
                for sock, _ in self.poller.poll(timeout=20):
                    if sock is self.control:
                        self._drain(self.control, self._on_control, router=True)
                    elif sock is self.weights:
                        self._drain(self.weights, self._on_weights, router=True)
                    else:
                        self._drain(self.intake_sock, self._on_intake, router=False)
                now = time.time()
                if now >= next_expire:
                    self._expire(now)
                    next_expire = now + 0.25
                if self._future is not None and self._future.done():
                    self._finish_step()
                out_of_time = budget_s and self.elapsed_s >= budget_s
                if out_of_time and not self._stop_requested:
                    self._stop_reason = f"max_minutes={self.cfg.max_minutes:g} reached"
                    self._stop_requested = True
                if not self._stop_requested:
                    self._maybe_start_step()
                finished = self.step >= self.cfg.max_steps or self._stop_requested
                if self._shutdown_at is None and finished and self._future is None:
                    self._begin_shutdown()
                if self._shutdown_at is not None and time.monotonic() >= self._shutdown_at:
                    break
            if not self._diverged:
                self._checkpoint(final=True)
            log.info(
                "trainer done: %d steps, version %d; %s",
                self.step,
                self.version,
                self.ledger.summary(),
            )
            return self.exit_code
        finally:
            self.metrics.close()
            self._close()

    def request_stop(self) -> None:
        """Finish the running step (if any), tell workers, checkpoint, return (any thread)."""
        self._stop_requested = True

    def _drain(self, sock: zmq.Socket, handler, *, router: bool) -> None:
        for _ in range(INTAKE_BURST):
            try:
                frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if self._from_revoked_key(frames):
                continue
            try:
                if router:
                    handler(frames[0].bytes, frames[1:])
                else:
                    handler(frames)
            except Exception:  # a handler bug must not take the run down; it is logged
                log.exception("error while handling a message; the message is dropped")
                self.counters["handler_errors"] = self.counters.get("handler_errors", 0) + 1

    def _from_revoked_key(self, frames: list) -> bool:
        """Whether ``frames`` came from a CURVE key removed from the allow-list after its
        connection was made: dropped and counted (the worker falls silent to the trainer and
        is declared lost as a dead one would be)."""
        if self.sockets.revoked_sender(frames) is None:
            return False
        self.counters["messages_revoked"] = self.counters.get("messages_revoked", 0) + 1
        return True

    def _reply(self, sock: zmq.Socket, peer: bytes, msg: Message) -> None:
        try:
            sock.send_multipart([peer, *encode(msg)], flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as err:  # the peer vanished (ROUTER_MANDATORY) or is not reading
            self.counters["replies_dropped"] = self.counters.get("replies_dropped", 0) + 1
            log.debug("reply %s dropped: %s", type(msg).__name__, err)

    # -------------------------------------------------------------------------- weights
    def _on_weights(self, peer: bytes, frames: list) -> None:
        try:
            msg = decode(frames, max_bytes=self.cfg.runtime.max_message_bytes)
        except ProtocolError as err:
            self.counters["weights_rejected"] += 1
            self._reply(self.weights, peer, err.to_refusal())
            return
        if not isinstance(msg, WeightRequest):
            self.counters["weights_rejected"] += 1
            reason = f"{type(msg).__name__} on the weights socket (only WeightRequest)"
            self._reply(self.weights, peer, Refusal(code="unexpected_kind", reason=reason))
            return
        self.weight_peers[peer] = msg.worker_id
        self.publisher.handle_request(self.weights, peer, msg)

    # --------------------------------------------------------------------------- intake
    def _on_intake(self, frames: list) -> None:
        if self.intake_tap is not None:
            try:
                self.intake_tap(frames)
            except Exception:
                log.exception("intake tap failed on a message; the message is still used")
        group, _ = self.intake.receive(frames, self.version)
        if group is not None:
            self.buffer.append(group)
            if self._observe_rewards is not None:
                self._observe_rewards(group.prompt, list(group.rewards.total))

    def _begin_shutdown(self) -> None:
        why = (
            self._stop_reason if self._stop_requested else f"max_steps={self.cfg.max_steps} reached"
        )
        log.info("%s at step %d; telling workers to shut down", why, self.step)
        self._shutdown_at = time.monotonic() + self.cfg.runtime.shutdown_grace_s
