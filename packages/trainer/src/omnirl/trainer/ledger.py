"""Leases, deadlines and exactly-once intake: pure bookkeeping, no sockets, no clocks.

Every prompt group is named by its ``group_id`` (its dataset position). A group is in one
of these states::

    pending   waiting to be (re)issued: a fresh prompt that has been drawn, or one whose
              lease expired, whose worker was lost, or whose result came back stale
    issued    out in a lease
    accepted  its scored result arrived and is buffered for training
    trained   consumed by an optimisation step (kept: a later copy is a duplicate)
    abandoned reissued more than ``max_reissues`` times (counted, never trained)

``accept()`` counts a ``group_id`` once, whichever copy arrives first (the original after a
reissue, or the reissue); every later copy is a :class:`Duplicate`.

**Staleness** is ``current_version - group.policy_version``. A group staler than
``max_staleness`` is dropped and counted, and its prompt is reissued (same ``group_id``)
unless another copy of it is already out, so stale results never lose data; the
``max_reissues`` cap keeps a hopeless prompt from circulating forever.

**Failed leases** (a worker gave a lease back, ``return_lease``): its open groups are
*suspect*. A suspect group goes out alone (a prompt that breaks sampling takes no other
group down with it) and, while a live rollout worker it has not failed on is available,
not to a worker it failed on. A worker whose last ``worker_failure_limit`` leases all came
back failed, with no group common to all of them, is *benched*: it gets no lease for
``bench_s``, doubled on each bench in a row (up to 32 times ``bench_s``); one completed
lease clears its record. So one
bad prompt (a group in every failed lease) benches no worker, while a worker that fails
everything stops burning the groups' reissues.

**Lease budget**: at most ``groups_per_step * (max_staleness + 1)`` groups are issued or
accepted-but-untrained at once. With ``max_staleness = 0`` that is one step's worth, so no
lease of version ``v + 1`` goes out until the step on version ``v`` has consumed its batch,
and leases only ever carry the current (published) version: synchronous, on-policy.

All times are passed in (``now``, seconds), which keeps this module deterministic.
"""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from omnirl.protocol.messages import PromptSpec


# ------------------------------------------------------------------------------- outcomes
@dataclass(frozen=True)
class Accepted:
    group_id: str
    staleness: int


@dataclass(frozen=True)
class Duplicate:
    group_id: str


@dataclass(frozen=True)
class Stale:
    group_id: str
    staleness: int
    reissued: bool


@dataclass(frozen=True)
class UnknownGroup:
    """Never issued by this ledger (nor by the run it was resumed from)."""

    group_id: str
    lease_id: str


@dataclass(frozen=True)
class FutureVersion:
    """Claims a policy version the trainer has not published."""

    group_id: str
    policy_version: int


Outcome = Accepted | Duplicate | Stale | UnknownGroup | FutureVersion


# --------------------------------------------------------------------------------- records
@dataclass
class LeaseRecord:
    lease_id: str
    worker_id: str
    prompts: list[PromptSpec]
    policy_version: int
    issued_at: float
    deadline: float
    open: set[str] = field(default_factory=set)  # group_ids not yet returned


@dataclass
class WorkerRecord:
    worker_id: str
    role: str
    last_seen: float
    policy_version: int = -1
    leases: list[str] = field(default_factory=list)  # as reported by its last heartbeat
    failed_leases: int = 0  # leases given back failed since its last completed one
    failed_common: set[str] | None = None  # groups in every one of those leases
    benched_until: float = 0.0
    benches: int = 0  # benches in a row (each doubles the next one's length)


@dataclass
class GroupRecord:
    prompt: PromptSpec
    state: str  # pending | issued | accepted | trained | abandoned
    lease_id: str = ""
    issues: int = 0  # how many times it went out
    failed_on: set[str] = field(default_factory=set)  # workers that gave it back failed


class Ledger:
    def __init__(
        self,
        *,
        groups_per_step: int,
        max_staleness: int = 0,
        lease_timeout_s: float = 300.0,
        heartbeat_timeout_s: float = 10.0,
        max_reissues: int = 5,
        worker_failure_limit: int = 3,
        bench_s: float = 30.0,
        run_id: str = "run",
    ):
        self.groups_per_step = groups_per_step
        self.max_staleness = max_staleness
        self.lease_timeout_s = lease_timeout_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.max_reissues = max_reissues
        self.worker_failure_limit = worker_failure_limit  # 0: never bench
        self.bench_s = bench_s
        self.run_id = run_id
        self.leases: dict[str, LeaseRecord] = {}
        self.workers: dict[str, WorkerRecord] = {}
        self.groups: dict[str, GroupRecord] = {}
        self.pending: OrderedDict[str, None] = OrderedDict()  # group_ids to (re)issue, FIFO
        self.counters: Counter[str] = Counter()
        self.states: Counter[str] = Counter()  # groups per state, kept in step with .groups
        self._lease_seq = itertools.count()
        self._generation = 0  # bumped on every resume so lease ids never repeat

    # ---------------------------------------------------------------------------- workers
    def heartbeat(
        self,
        worker_id: str,
        now: float,
        *,
        role: str = "rollout",
        policy_version: int = -1,
        leases: list[str] | None = None,
    ) -> None:
        """Record a sign of life (a Hello, a Heartbeat or any request)."""
        rec = self.workers.get(worker_id)
        if rec is None:
            rec = self.workers[worker_id] = WorkerRecord(worker_id, role, now)
            self.counters["workers_joined"] += 1
        rec.last_seen = now
        rec.role = role
        if policy_version >= 0:
            rec.policy_version = policy_version
        if leases is not None:
            rec.leases = list(leases)

    def live_workers(self, role: str | None = None) -> list[WorkerRecord]:
        return [w for w in self.workers.values() if role is None or w.role == role]

    def benched_for(self, worker_id: str, now: float) -> float:
        """Seconds left on ``worker_id``'s bench (0: it may take leases)."""
        rec = self.workers.get(worker_id)
        return max(0.0, rec.benched_until - now) if rec is not None else 0.0

    # ----------------------------------------------------------------------------- leases
    def in_flight(self) -> int:
        """Groups issued or accepted but not yet trained (what the lease budget bounds)."""
        return self.states["issued"] + self.states["accepted"]

    def budget(self) -> int:
        return self.groups_per_step * (self.max_staleness + 1) - self.in_flight()

    def issue(
        self,
        worker_id: str,
        capacity: int,
        now: float,
        *,
        policy_version: int,
        fresh: Callable[[], PromptSpec],
    ) -> LeaseRecord | None:
        """A lease of up to ``capacity`` groups (reissues first, then ``fresh()`` prompts).

        Returns None when the lease budget is spent (see the module docstring).
        """
        n = min(max(capacity, 0), self.budget())
        if n <= 0:
            return None
        prompts = [self.groups[gid].prompt for gid in self._reissues_for(worker_id, n, now)]
        self.counters["groups_reissued"] += len(prompts)
        if prompts and self.groups[prompts[0].group_id].failed_on:
            n = 1  # a suspect group goes out alone
        while len(prompts) < n:
            prompt = fresh()
            if prompt.group_id in self.groups:  # the data source wrapped onto a live id
                raise ValueError(f"fresh prompt {prompt.group_id!r} is already in the ledger")
            self._add(GroupRecord(prompt, "pending"))
            prompts.append(prompt)
            self.counters["groups_issued"] += 1
        lease_id = f"{self.run_id}:g{self._generation}:l{next(self._lease_seq)}"
        lease = LeaseRecord(
            lease_id=lease_id,
            worker_id=worker_id,
            prompts=prompts,
            policy_version=policy_version,
            issued_at=now,
            deadline=now + self.lease_timeout_s,
            open={p.group_id for p in prompts},
        )
        for p in prompts:
            g = self.groups[p.group_id]
            self._move(g, "issued")
            g.lease_id = lease_id
            g.issues += 1
        self.leases[lease_id] = lease
        self.counters["leases_issued"] += 1
        return lease

    def expire(self, now: float) -> list[str]:
        """Close leases past their deadline or held by a worker that stopped heartbeating.

        Their open groups go back to ``pending`` (same ``group_id``). Lost workers are
        forgotten. Returns the expired lease ids.
        """
        lost = {
            w.worker_id
            for w in self.workers.values()
            if now - w.last_seen > self.heartbeat_timeout_s
        }
        for wid in lost:
            del self.workers[wid]
            self.counters["workers_lost"] += 1
        expired = []
        for lease in list(self.leases.values()):
            if lease.worker_id in lost or lease.worker_id not in self.workers:
                self.counters["leases_lost_worker"] += 1
            elif now > lease.deadline:
                self.counters["leases_expired"] += 1
            else:
                continue
            self._close(lease, requeue=True)
            expired.append(lease.lease_id)
        return expired

    def _reissues_for(self, worker_id: str, n: int, now: float) -> list[str]:
        """Take up to ``n`` pending groups for ``worker_id``, oldest first: a suspect group
        alone, and none that failed on this worker while another available one has not."""
        available = {
            w.worker_id
            for w in self.workers.values()
            if w.role == "rollout" and w.benched_until <= now
        } | {worker_id}
        taken: list[str] = []
        for gid in self.pending:
            failed_on = self.groups[gid].failed_on
            if worker_id in failed_on and not available <= failed_on:
                continue  # another worker may succeed where this one failed
            if failed_on and taken:
                continue  # suspect: it goes out in a lease of its own
            taken.append(gid)
            if failed_on or len(taken) == n:
                break
        for gid in taken:
            del self.pending[gid]
        return taken

    def return_lease(self, lease_id: str, worker_id: str, now: float) -> bool:
        """A worker gave ``lease_id`` back unfinished: its open groups go back to
        ``pending`` now, marked suspect, and the worker's failures are counted (it may be
        benched, see the module docstring). Returns False (nothing changes) for a lease
        that is no longer open or is not that worker's."""
        lease = self.leases.get(lease_id)
        if lease is None or lease.worker_id != worker_id:
            return False
        self.counters["leases_returned"] += 1
        for gid in lease.open:
            self.groups[gid].failed_on.add(worker_id)
        rec = self.workers.get(worker_id)
        if rec is not None:
            rec.failed_leases += 1
            common = set(lease.open) if rec.failed_common is None else rec.failed_common
            rec.failed_common = common & lease.open
            limit = self.worker_failure_limit
            if limit and rec.failed_leases >= limit and not rec.failed_common:
                rec.benched_until = now + self.bench_s * 2 ** min(rec.benches, 5)
                rec.benches += 1
                self.counters["workers_benched"] += 1
        self._close(lease, requeue=True)
        return True

    def _add(self, g: GroupRecord) -> None:
        self.groups[g.prompt.group_id] = g
        self.states[g.state] += 1

    def _move(self, g: GroupRecord, state: str) -> None:
        self.states[g.state] -= 1
        self.states[state] += 1
        g.state = state

    def _close(self, lease: LeaseRecord, *, requeue: bool) -> None:
        del self.leases[lease.lease_id]
        if requeue:
            for gid in sorted(lease.open):
                self._requeue(gid)
        lease.open.clear()

    def _requeue(self, gid: str) -> bool:
        g = self.groups[gid]
        if g.issues > self.max_reissues:
            self._move(g, "abandoned")
            self.counters["groups_abandoned"] += 1
            return False
        self._move(g, "pending")
        g.lease_id = ""
        self.pending[gid] = None
        return True

    def _settle(self, gid: str) -> None:
        """Take ``gid`` out of whatever lease / queue holds it (it has been answered)."""
        g = self.groups[gid]
        self.pending.pop(gid, None)
        lease = self.leases.get(g.lease_id)
        if lease is not None:
            lease.open.discard(gid)
            if not lease.open:
                del self.leases[lease.lease_id]
                self.counters["leases_completed"] += 1
                rec = self.workers.get(lease.worker_id)
                if rec is not None:  # it works again: forget its failures
                    rec.failed_leases, rec.benches, rec.failed_common = 0, 0, None
        g.lease_id = ""

    # ----------------------------------------------------------------------------- intake
    def accept(
        self, group_id: str, lease_id: str, policy_version: int, current_version: int
    ) -> Outcome:
        """Decide what a scored group that just arrived counts as."""
        g = self.groups.get(group_id)
        if g is None:
            self.counters["groups_unknown"] += 1
            return UnknownGroup(group_id, lease_id)
        if policy_version > current_version:
            self.counters["groups_future_version"] += 1
            return FutureVersion(group_id, policy_version)
        if g.state in ("accepted", "trained", "abandoned"):
            self.counters["groups_duplicate"] += 1
            return Duplicate(group_id)
        staleness = current_version - policy_version
        if staleness > self.max_staleness:
            self.counters["groups_stale"] += 1
            # reissue only if this copy answers the lease that currently holds the group,
            # or the group is already waiting; otherwise another copy is still out
            reissued = False
            if g.state == "pending":
                reissued = True
            elif g.lease_id == lease_id:
                self._settle(group_id)
                reissued = self._requeue(group_id)
            return Stale(group_id, staleness, reissued)
        self._settle(group_id)
        self._move(g, "accepted")
        self.counters["groups_accepted"] += 1
        return Accepted(group_id, staleness)

    def mark_trained(self, group_ids: list[str]) -> None:
        for gid in group_ids:
            self._move(self.groups[gid], "trained")
        self.counters["groups_trained"] += len(group_ids)

    def requeue_accepted(self, group_ids: list[str]) -> None:
        """Accepted groups the trainer could not use after all (e.g. stale at step time)."""
        for gid in group_ids:
            if self.groups[gid].state == "accepted":
                self._requeue(gid)

    # ------------------------------------------------------------------------ persistence
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume. Issued and accepted-but-untrained groups are saved
        as pending: on resume they are issued again (same ``group_id``s), each with the
        workers it failed on (still suspect). Finished groups are kept by id only."""
        live = [gid for gid, g in self.groups.items() if g.state in ("issued", "accepted")]
        order = list(self.pending) + live
        return {
            "open": [
                {
                    "group_id": gid,
                    "text": self.groups[gid].prompt.text,
                    "metadata": self.groups[gid].prompt.metadata,
                    "issues": self.groups[gid].issues,
                    "failed_on": sorted(self.groups[gid].failed_on),
                }
                for gid in order
            ],
            "trained": [gid for gid, g in self.groups.items() if g.state == "trained"],
            "abandoned": [gid for gid, g in self.groups.items() if g.state == "abandoned"],
            "counters": dict(self.counters),
            "generation": self._generation,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.leases.clear()
        self.workers.clear()
        self.groups = {}
        self.states = Counter()
        for kind in ("trained", "abandoned"):
            for gid in state[kind]:
                self._add(GroupRecord(PromptSpec(group_id=gid, text=""), kind))
        self.pending = OrderedDict()
        for r in state["open"]:
            prompt = PromptSpec(
                group_id=r["group_id"], text=r["text"], metadata=dict(r["metadata"])
            )
            failed_on = set(r.get("failed_on", ()))  # absent in checkpoints before it
            self._add(GroupRecord(prompt, "pending", issues=int(r["issues"]), failed_on=failed_on))
            self.pending[prompt.group_id] = None
        self.counters = Counter(state["counters"])
        self._generation = int(state["generation"]) + 1
        self._lease_seq = itertools.count()

    # ----------------------------------------------------------------------------- status
    def summary(self) -> dict[str, int]:
        states = self.states
        return {
            "leases_in_flight": len(self.leases),
            "groups_pending": len(self.pending),
            "groups_in_flight": states["issued"],
            "groups_buffered": states["accepted"],
            **{k: int(v) for k, v in sorted(self.counters.items())},
        }
