"""The ledger: leases, reissue on deadline / lost heartbeat, exactly-once, staleness, state."""

from __future__ import annotations

import itertools

from omnirl.protocol.messages import PromptSpec
from omnirl.trainer.ledger import (
    Accepted,
    Duplicate,
    FutureVersion,
    Ledger,
    Stale,
    UnknownGroup,
)


def _fresh():
    counter = itertools.count()
    return lambda: PromptSpec(group_id=f"e0:i{next(counter)}", text="p")


def _fresh_from(start):
    counter = itertools.count(start)
    return lambda: PromptSpec(group_id=f"e0:i{next(counter)}", text="p")


def _ledger(**kw):
    args = dict(groups_per_step=4, max_staleness=0, lease_timeout_s=10.0, heartbeat_timeout_s=3.0)
    args.update(kw)
    return Ledger(**args)


def test_deadline_reissues_same_group_ids_and_late_original_counts_once():
    led, fresh = _ledger(), _fresh()
    led.heartbeat("w1", 0.0)
    led.heartbeat("w2", 0.0)
    a = led.issue("w1", 2, 0.0, policy_version=0, fresh=fresh)
    assert [p.group_id for p in a.prompts] == ["e0:i0", "e0:i1"]
    led.heartbeat("w1", 9.0)
    led.heartbeat("w2", 9.0)
    assert led.expire(9.0) == []
    led.heartbeat("w1", 10.5)
    led.heartbeat("w2", 10.5)
    assert led.expire(10.5) == [a.lease_id]  # deadline 10.0 passed
    assert led.counters["leases_expired"] == 1
    b = led.issue("w2", 2, 11.0, policy_version=0, fresh=fresh)
    assert b.lease_id != a.lease_id
    assert [p.group_id for p in b.prompts] == ["e0:i0", "e0:i1"]  # same names, reissued
    assert led.counters["groups_reissued"] == 2
    # the late original arrives first: it counts; the reissued copy is then a duplicate
    assert isinstance(led.accept("e0:i0", a.lease_id, 0, 0), Accepted)
    assert isinstance(led.accept("e0:i0", b.lease_id, 0, 0), Duplicate)
    assert isinstance(led.accept("e0:i1", b.lease_id, 0, 0), Accepted)
    assert isinstance(led.accept("e0:i1", a.lease_id, 0, 0), Duplicate)
    assert led.counters["groups_accepted"] == 2 and led.counters["groups_duplicate"] == 2
    assert b.lease_id not in led.leases  # every group of the reissue answered: closed


def test_lost_heartbeat_reissues_and_forgets_the_worker():
    led, fresh = _ledger(lease_timeout_s=100.0), _fresh()
    led.heartbeat("dead", 0.0)
    led.heartbeat("alive", 0.0)
    lease = led.issue("dead", 3, 0.0, policy_version=0, fresh=fresh)
    led.heartbeat("alive", 2.0)
    led.heartbeat("alive", 4.0)
    assert led.expire(4.0) == [lease.lease_id]
    assert "dead" not in led.workers and "alive" in led.workers
    assert led.counters["workers_lost"] == 1 and led.counters["leases_lost_worker"] == 1
    again = led.issue("alive", 4, 4.0, policy_version=0, fresh=fresh)
    assert [p.group_id for p in again.prompts] == ["e0:i0", "e0:i1", "e0:i2", "e0:i3"]


def test_partial_lease_only_reissues_open_groups():
    led, fresh = _ledger(), _fresh()
    led.heartbeat("w", 0.0)
    lease = led.issue("w", 3, 0.0, policy_version=0, fresh=fresh)
    led.accept("e0:i1", lease.lease_id, 0, 0)
    led.heartbeat("w", 11.0)
    led.expire(11.0)
    again = led.issue("w", 3, 11.0, policy_version=0, fresh=fresh)
    assert [p.group_id for p in again.prompts] == ["e0:i0", "e0:i2", "e0:i3"]


def test_budget_is_one_step_when_synchronous_and_k_plus_one_steps_when_async():
    sync, fresh = _ledger(groups_per_step=2, max_staleness=0), _fresh()
    sync.heartbeat("w", 0.0)
    assert len(sync.issue("w", 5, 0.0, policy_version=0, fresh=fresh).prompts) == 2
    assert sync.issue("w", 1, 0.0, policy_version=0, fresh=fresh) is None  # wait for the step
    for gid in ("e0:i0", "e0:i1"):
        sync.accept(gid, "", 0, 0)
    assert sync.issue("w", 1, 0.0, policy_version=0, fresh=fresh) is None  # buffered, untrained
    sync.mark_trained(["e0:i0", "e0:i1"])
    assert len(sync.issue("w", 5, 0.0, policy_version=1, fresh=fresh).prompts) == 2
    async_ = _ledger(groups_per_step=2, max_staleness=2)
    async_.heartbeat("w", 0.0)
    assert len(async_.issue("w", 10, 0.0, policy_version=0, fresh=_fresh()).prompts) == 6


def test_stale_groups_are_dropped_counted_and_reissued_once():
    led, fresh = _ledger(max_staleness=1), _fresh()
    led.heartbeat("w", 0.0)
    lease = led.issue("w", 2, 0.0, policy_version=0, fresh=fresh)
    out = led.accept("e0:i0", lease.lease_id, 0, 2)  # two versions old, K=1
    assert isinstance(out, Stale) and out.staleness == 2 and out.reissued
    assert led.counters["groups_stale"] == 1
    assert isinstance(led.accept("e0:i1", lease.lease_id, 1, 2), Accepted)
    again = led.issue("w", 4, 1.0, policy_version=2, fresh=fresh)
    assert again.prompts[0].group_id == "e0:i0"
    # a second stale copy from the old lease does not queue it twice
    out = led.accept("e0:i0", lease.lease_id, 0, 2)
    assert isinstance(out, Stale) and not out.reissued
    assert list(led.pending) == []


def test_unknown_and_future_groups_are_refused_and_counted():
    led = _ledger()
    assert isinstance(led.accept("e9:i9", "nope", 0, 0), UnknownGroup)
    led.heartbeat("w", 0.0)
    lease = led.issue("w", 1, 0.0, policy_version=0, fresh=_fresh())
    assert isinstance(led.accept("e0:i0", lease.lease_id, 3, 0), FutureVersion)
    assert led.counters["groups_unknown"] == 1 and led.counters["groups_future_version"] == 1


def test_reissue_cap_abandons_a_group():
    led, fresh = _ledger(max_reissues=1, lease_timeout_s=1.0), _fresh()
    led.heartbeat("w", 0.0)
    led.issue("w", 1, 0.0, policy_version=0, fresh=fresh)
    for t in (2.0, 4.0):
        led.heartbeat("w", t)
        led.expire(t)
        led.issue("w", 1, t, policy_version=0, fresh=fresh)
    assert led.counters["groups_abandoned"] == 1
    assert isinstance(led.accept("e0:i0", "", 0, 0), Duplicate)


def test_state_round_trip_reissues_in_flight_and_keeps_exactly_once():
    led, fresh = _ledger(groups_per_step=2, max_staleness=1), _fresh()
    led.heartbeat("w", 0.0)
    a = led.issue("w", 2, 0.0, policy_version=0, fresh=fresh)
    led.accept("e0:i0", a.lease_id, 0, 0)
    led.mark_trained(["e0:i0"])
    led.accept("e0:i1", a.lease_id, 0, 0)  # accepted, not trained: lost with the process
    b = led.issue("w", 1, 0.0, policy_version=0, fresh=fresh)  # in flight at checkpoint
    state = led.state_dict()

    resumed = _ledger(groups_per_step=2, max_staleness=1)
    resumed.load_state_dict(state)
    assert resumed.counters == led.counters
    resumed.heartbeat("w2", 5.0)
    again = resumed.issue("w2", 3, 5.0, policy_version=1, fresh=_fresh_from(3))
    assert [p.group_id for p in again.prompts][:2] == ["e0:i1", "e0:i2"]
    assert again.lease_id not in (a.lease_id, b.lease_id)
    assert again.prompts[0].text == "p"
    assert isinstance(resumed.accept("e0:i0", a.lease_id, 0, 1), Duplicate)  # trained before
    # a surviving worker's copy of the pre-checkpoint lease still counts once
    assert isinstance(resumed.accept("e0:i2", b.lease_id, 0, 1), Accepted)
    assert isinstance(resumed.accept("e0:i2", again.lease_id, 1, 1), Duplicate)


def test_state_counts_stay_in_step_with_the_groups():
    from collections import Counter

    led, fresh = _ledger(groups_per_step=3, max_staleness=1, lease_timeout_s=1.0), _fresh()
    led.heartbeat("w", 0.0)
    a = led.issue("w", 3, 0.0, policy_version=0, fresh=fresh)
    led.accept("e0:i0", a.lease_id, 0, 0)
    led.accept("e0:i1", a.lease_id, 0, 2)  # stale: back to pending
    led.mark_trained(["e0:i0"])
    led.heartbeat("w", 2.0)
    led.expire(2.0)
    led.issue("w", 2, 2.0, policy_version=1, fresh=fresh)
    assert led.states == Counter(g.state for g in led.groups.values())
    assert led.in_flight() == 2


def test_a_returned_lease_reissues_its_open_groups_at_once():
    led, fresh = _ledger(), _fresh()
    led.heartbeat("w1", 0.0)
    led.heartbeat("w2", 0.0)
    a = led.issue("w1", 2, 0.0, policy_version=0, fresh=fresh)
    assert isinstance(led.accept("e0:i0", a.lease_id, 0, 0), Accepted)  # one came back
    assert not led.return_lease(a.lease_id, "w2")  # not w2's to give back
    assert led.return_lease(a.lease_id, "w1")
    assert a.lease_id not in led.leases and list(led.pending) == ["e0:i1"]
    assert led.counters["leases_returned"] == 1
    assert not led.return_lease(a.lease_id, "w1")  # already closed: nothing changes
    b = led.issue("w2", 2, 1.0, policy_version=0, fresh=fresh)  # long before a's deadline
    assert [p.group_id for p in b.prompts] == ["e0:i1", "e0:i2"]
    assert led.counters["groups_reissued"] == 1
