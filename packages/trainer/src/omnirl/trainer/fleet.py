"""The trainer's side of the conversation on ``control``: registration, welcomes, leases,
heartbeats, lost workers, status (see docs/architecture.md, "The conversation").

:class:`FleetControl` is a part of :class:`~omnirl.trainer.server.TrainerServer` (a mixin):
it uses the server's ledger, prompt source, backend, addresses and reply function, and
owns the fleet's registry (who is live, where reward workers listen, routing ids).
"""

from __future__ import annotations

import logging
import time
import zlib

from omnirl.protocol.codec import decode
from omnirl.protocol.errors import ProtocolError
from omnirl.protocol.messages import (
    Heartbeat,
    Hello,
    Lease,
    LeaseRequest,
    LeaseReturn,
    Refusal,
    SamplingParams,
    Status,
    StatusRequest,
    Topology,
    Welcome,
    WorkerStatus,
)

log = logging.getLogger("omnirl.trainer")


class FleetControl:
    """Handlers of the ``control`` ROUTER; mixed into the server."""

    def _init_fleet(self, cfg) -> None:
        from omnirl.trainer.config import to_container

        self.rewards: dict[str, str] = {}  # live reward worker id -> its PULL address
        self.control_peers: dict[str, bytes] = {}  # worker id -> its control routing id
        self.known: dict[str, tuple[str, str]] = {}  # every worker that said Hello: role, address
        self.weight_peers: dict[bytes, str] = {}  # weights routing id -> worker id
        self._welcomed_rewards: set[str] = set()
        self._worker_config = to_container(cfg)
        self._rr = 0

    def _on_control(self, peer: bytes, frames: list) -> None:
        try:
            msg = decode(frames, max_bytes=self.cfg.runtime.max_message_bytes)
        except ProtocolError as err:
            self.counters["control_rejected"] += 1
            log.warning("control: rejected message (%s): %s", err.code, err)
            self._reply(self.control, peer, err.to_refusal())
            return
        now = time.time()
        if isinstance(msg, StatusRequest):
            self._reply(self.control, peer, self.status())
        elif self._shutdown_at is not None:
            self._reply(self.control, peer, Refusal(code="shutdown", reason="the run has finished"))
        elif isinstance(msg, Hello):
            self._on_hello(peer, msg, now)
        elif isinstance(msg, LeaseRequest | Heartbeat | LeaseReturn):
            if msg.worker_id not in self.ledger.workers and not self._readmit(msg.worker_id, now):
                reason = f"worker {msg.worker_id!r} is not registered (send Hello)"
                refusal = Refusal(code="unknown_worker", reason=reason, ref=msg.worker_id)
                self._reply(self.control, peer, refusal)
                return
            role = self.ledger.workers[msg.worker_id].role
            self.control_peers[msg.worker_id] = peer
            if isinstance(msg, Heartbeat):
                self.ledger.heartbeat(
                    msg.worker_id,
                    now,
                    role=role,
                    policy_version=msg.policy_version,
                    leases=msg.leases,
                )
            elif isinstance(msg, LeaseReturn):
                self.ledger.heartbeat(msg.worker_id, now, role=role)
                self._on_lease_return(msg, now)
            else:
                self.ledger.heartbeat(msg.worker_id, now, role=role)
                self._reply(self.control, peer, self._lease_for(msg, now))
        else:
            self.counters["control_rejected"] += 1
            reason = f"{type(msg).__name__} is not a control request"
            self._reply(self.control, peer, Refusal(code="unexpected_kind", reason=reason))

    def _on_lease_return(self, msg: LeaseReturn, now: float) -> None:
        benched = self.ledger.benched_for(msg.worker_id, now)
        if not self.ledger.return_lease(msg.lease_id, msg.worker_id, now):
            # expired already (and reissued), or finished
            log.info("worker %s gave back lease %s, no longer open", msg.worker_id, msg.lease_id)
            return
        if msg.bad_sampling:
            self._stop_on_bad_sampling(msg)
            return
        log.warning(
            "worker %s gave lease %s back unfinished (%s); its groups are issued again",
            msg.worker_id,
            msg.lease_id,
            msg.reason or "no reason given",
        )
        bench = self.ledger.benched_for(msg.worker_id, now)
        if bench > benched:
            rec = self.ledger.workers[msg.worker_id]
            log.warning(
                "worker %s benched for %.0f s: its last %d leases failed, with no group "
                "common to them; it gets no lease until then (runtime.worker_failure_limit)",
                msg.worker_id,
                bench,
                rec.failed_leases,
            )

    def _stop_on_bad_sampling(self, msg: LeaseReturn) -> None:
        """The model refused the run's sampling parameters: no worker can sample any lease,
        so end the run (exit code 2, a configuration error) instead of issuing it again."""
        if self._stop_requested:
            return
        log.error(
            "worker %s: the model refuses this run's sampling parameters: %s. Every lease "
            "would fail the same way; change the run's sampling settings (sampling.*) and "
            "start again. Stopping.",
            msg.worker_id,
            msg.reason or "no reason given",
        )
        self._stop_reason = f"the model refuses the run's sampling parameters ({msg.reason})"
        self.exit_code = 2
        self.request_stop()

    def _readmit(self, worker_id: str, now: float) -> bool:
        """A worker declared lost that speaks again (a long stall, not a death): take it
        back without a new Hello. Its leases were reissued; its late groups count once."""
        known = self.known.get(worker_id)
        if known is None:
            return False
        role, address = known
        self.ledger.heartbeat(worker_id, now, role=role)
        if role == "reward":
            self.rewards[worker_id] = address
        self.ledger.counters["workers_readmitted"] += 1
        log.info("%s worker %s is back", role, worker_id)
        return True

    def _on_hello(self, peer: bytes, msg: Hello, now: float) -> None:
        if msg.role not in ("rollout", "reward", "client", "tap"):
            self._reply(self.control, peer, Refusal(code="bad_role", reason=f"role {msg.role!r}"))
            return
        if msg.role == "reward":
            if not msg.address:
                reason = "a reward worker must give the address of its PULL in Hello.address"
                self._reply(self.control, peer, Refusal(code="bad_hello", reason=reason))
                return
            self.rewards[msg.worker_id] = msg.address
        self.known[msg.worker_id] = (msg.role, msg.address)
        self.ledger.heartbeat(msg.worker_id, now, role=msg.role)
        log.info(
            "%s worker %s joined%s",
            msg.role,
            msg.worker_id,
            f" ({msg.address})" if msg.address else "",
        )
        self.control_peers[msg.worker_id] = peer
        self._reply(self.control, peer, self._welcome(msg.worker_id))
        if msg.role == "reward" and msg.address not in self._welcomed_rewards:
            self._rewelcome_rollouts()

    def _welcome(self, worker_id: str) -> Welcome:
        return Welcome(
            worker_id=worker_id,
            run_id=self.run_id,
            topology=Topology(
                control=self.addresses["control"],
                intake=self.addresses["intake"],
                weights=self.addresses["weights"],
                reward=sorted(self.rewards.values()),
            ),
            policy_version=self.version,
            model_path=self.backend.model_path,
            architecture=self.backend.architecture,
            heartbeat_interval_s=self.cfg.runtime.heartbeat_interval_s,
            config=self._worker_config,
        )

    def _rewelcome_rollouts(self) -> None:
        """A new reward worker: send every live rollout worker a Welcome with the new
        topology, so that a rollout that joined before any reward worker learns where to
        send its groups (a repeated Welcome only adds addresses on the worker's side)."""
        self._welcomed_rewards = set(self.rewards.values())
        for w in self.ledger.live_workers("rollout"):
            peer = self.control_peers.get(w.worker_id)
            if peer is not None:
                self._reply(self.control, peer, self._welcome(w.worker_id))

    def _lease_for(self, req: LeaseRequest, now: float) -> Lease | Refusal:
        if not self.rewards:
            return Refusal(code="no_work", reason="no reward worker has registered yet")
        if self.step >= self.cfg.max_steps:
            return Refusal(code="no_work", reason="max_steps reached")
        bench = self.ledger.benched_for(req.worker_id, now)
        if bench > 0:
            reason = f"worker {req.worker_id!r} is benched for {bench:.0f} s: its leases failed"
            return Refusal(code="no_work", reason=reason, ref=req.worker_id, retry_after_s=bench)
        capacity = max(1, min(req.capacity, self.cfg.data.prompts_per_lease))
        lease = self.ledger.issue(
            req.worker_id, capacity, now, policy_version=self.version, fresh=self.prompts.next
        )
        if lease is None:
            return Refusal(code="no_work", reason="lease budget spent; waiting for the next step")
        rewards = sorted(self.rewards.values())
        self._rr += 1
        return Lease(
            lease_id=lease.lease_id,
            worker_id=req.worker_id,
            prompts=lease.prompts,
            sampling=self._sampling(lease.lease_id),
            deadline=lease.deadline,
            policy_version=self.version,
            reward_address=rewards[self._rr % len(rewards)],
        )

    def _sampling(self, lease_id: str) -> SamplingParams:
        from omnirl.trainer.algorithms.windows import lease_sampling_params

        seed = zlib.crc32(f"{self.cfg.run.seed}:{lease_id}".encode())
        return lease_sampling_params(self.cfg, seed=seed, step=self.step)

    def _expire(self, now: float) -> None:
        before = set(self.ledger.workers)
        expired = self.ledger.expire(now)
        for wid in before - set(self.ledger.workers):
            log.warning(
                "worker %s lost (no heartbeat for %.1f s)",
                wid,
                self.cfg.runtime.heartbeat_timeout_s,
            )
            self.rewards.pop(wid, None)
            for peer, owner in list(self.weight_peers.items()):
                if owner == wid:
                    self.publisher.forget(peer)
                    del self.weight_peers[peer]
        if expired:
            log.warning("leases expired, their groups will be issued again: %s", ", ".join(expired))

    # --------------------------------------------------------------------------- status
    def status(self) -> Status:
        now = time.time()
        workers = [
            WorkerStatus(
                worker_id=w.worker_id,
                role=w.role,
                policy_version=w.policy_version,
                last_seen_s=now - w.last_seen,
                leases=[
                    lid
                    for lid, lease in self.ledger.leases.items()
                    if lease.worker_id == w.worker_id
                ],
                address=self.rewards.get(w.worker_id, ""),
                benched_s=self.ledger.benched_for(w.worker_id, now),
            )
            for w in self.ledger.workers.values()
        ]
        state = (
            "shutdown"
            if self._shutdown_at is not None
            else "stepping"
            if self._future
            else "running"
        )
        counters = {**self.ledger.summary(), **self.counters}
        counters.update({f"intake_{k}": v for k, v in self.intake.outcomes.items()})
        counters.update({f"rejected_{k}": v for k, v in self.intake.rejected.items()})
        return Status(
            run_id=self.run_id,
            state=state,
            policy_version=self.version,
            step=self.step,
            max_steps=self.cfg.max_steps,
            workers=workers,
            leases_in_flight=len(self.ledger.leases),
            groups_buffered=len(self.buffer),
            intake_rate=self.intake.rate(),
            counters={k: int(v) for k, v in counters.items()},
        )
