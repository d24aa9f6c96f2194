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
    assert not led.return_lease(a.lease_id, "w2", 0.5)  # not w2's to give back
    assert led.return_lease(a.lease_id, "w1", 0.5)
    assert a.lease_id not in led.leases and list(led.pending) == ["e0:i1"]
    assert led.counters["leases_returned"] == 1
    assert not led.return_lease(a.lease_id, "w1", 0.6)  # already closed: nothing changes
    b = led.issue("w2", 2, 1.0, policy_version=0, fresh=fresh)  # long before a's deadline
    assert [p.group_id for p in b.prompts] == ["e0:i1"]  # suspect: alone
    assert led.counters["groups_reissued"] == 1
    c = led.issue("w2", 2, 1.0, policy_version=0, fresh=fresh)
    assert [p.group_id for p in c.prompts] == ["e0:i2", "e0:i3"]  # fresh ones: as asked


def _fail(led, worker, now, fresh, capacity=1):
    """``worker`` takes a lease and gives it back failed; returns the lease's group ids."""
    lease = led.issue(worker, capacity, now, policy_version=0, fresh=fresh)
    assert led.return_lease(lease.lease_id, worker, now)
    return [p.group_id for p in lease.prompts]


def test_a_failed_group_goes_to_another_worker_while_one_is_available():
    led, fresh = _ledger(groups_per_step=8), _fresh()
    for w in ("w1", "w2"):
        led.heartbeat(w, 0.0)
    assert _fail(led, "w1", 0.0, fresh, capacity=3) == ["e0:i0", "e0:i1", "e0:i2"]
    # w1 asks again: none of its failed groups, fresh ones instead
    again = led.issue("w1", 2, 0.1, policy_version=0, fresh=fresh)
    assert [p.group_id for p in again.prompts] == ["e0:i3", "e0:i4"]
    # w2 takes them one lease each, oldest first
    for gid in ("e0:i0", "e0:i1", "e0:i2"):
        lease = led.issue("w2", 3, 0.2, policy_version=0, fresh=fresh)
        assert [p.group_id for p in lease.prompts] == [gid]
    # once w2 has failed on a group too, it may go back to w1 (no other worker is left)
    led2, fresh2 = _ledger(), _fresh()
    for w in ("w1", "w2"):
        led2.heartbeat(w, 0.0)
    assert _fail(led2, "w1", 0.0, fresh2) == ["e0:i0"]
    assert _fail(led2, "w2", 0.1, fresh2) == ["e0:i0"]
    assert [
        p.group_id for p in led2.issue("w1", 1, 0.2, policy_version=0, fresh=fresh2).prompts
    ] == ["e0:i0"]


def test_a_failed_group_stays_suspect_across_a_checkpoint():
    led, fresh = _ledger(groups_per_step=8), _fresh()
    for w in ("w1", "w2"):
        led.heartbeat(w, 0.0)
    assert _fail(led, "w1", 0.0, fresh, capacity=2) == ["e0:i0", "e0:i1"]
    resumed = _ledger(groups_per_step=8)
    resumed.load_state_dict(led.state_dict())
    assert resumed.groups["e0:i0"].failed_on == {"w1"}
    for w in ("w1", "w2"):  # the workers register again under their ids
        resumed.heartbeat(w, 1.0)
    again = resumed.issue("w1", 2, 1.0, policy_version=0, fresh=_fresh_from(2))
    assert [p.group_id for p in again.prompts] == ["e0:i2", "e0:i3"]  # not the failed ones
    lease = resumed.issue("w2", 2, 1.0, policy_version=0, fresh=_fresh_from(4))
    assert [p.group_id for p in lease.prompts] == ["e0:i0"]  # alone, to the other worker
    # a checkpoint written before groups kept their failures resumes them as not suspect
    state = led.state_dict()
    for r in state["open"]:
        del r["failed_on"]
    old = _ledger(groups_per_step=8)
    old.load_state_dict(state)
    assert all(not g.failed_on for g in old.groups.values())


def test_the_only_worker_gets_its_failed_group_back():
    led, fresh = _ledger(), _fresh()
    led.heartbeat("w1", 0.0)
    led.heartbeat("reward-0", 0.0, role="reward")  # not a rollout worker: no alternative
    assert _fail(led, "w1", 0.0, fresh) == ["e0:i0"]
    for t in range(1, 5):  # one group failing again and again benches nobody (a bad prompt?)
        assert _fail(led, "w1", float(t), fresh, capacity=2) == ["e0:i0"]  # alone
    assert led.benched_for("w1", 5.0) == 0.0
    assert _fail(led, "w1", 5.0, fresh) == ["e0:i0"]  # issued a sixth time: abandoned
    assert led.groups["e0:i0"].state == "abandoned"
    assert _fail(led, "w1", 6.0, fresh) == ["e0:i1"]  # the next group fails too: benched
    assert led.benched_for("w1", 6.0) == 30.0


def test_a_worker_that_fails_every_lease_is_benched_with_doubling_length():
    led, fresh = _ledger(groups_per_step=16, worker_failure_limit=3, bench_s=30.0), _fresh()
    for w in ("w1", "w2"):
        led.heartbeat(w, 0.0)
    _fail(led, "w1", 0.0, fresh)
    _fail(led, "w1", 1.0, fresh)
    assert led.benched_for("w1", 1.0) == 0.0
    _fail(led, "w1", 2.0, fresh)  # third failure, third distinct group
    assert led.benched_for("w1", 2.0) == 30.0 and led.benched_for("w2", 2.0) == 0.0
    assert led.counters["workers_benched"] == 1
    # while w1 sits out, its three groups are w2's (w1 is not available to take them)
    assert [p.group_id for p in led.issue("w2", 4, 3.0, policy_version=0, fresh=fresh).prompts] == [
        "e0:i0"
    ]
    # back after the bench, it fails once more: benched again at once, twice as long
    _fail(led, "w1", 33.0, fresh)
    assert led.benched_for("w1", 33.0) == 60.0
    # the length stops doubling at 32 benches' worth
    for i, t in enumerate((93.0, 214.0, 455.0, 936.0, 1897.0)):
        _fail(led, "w1", t, fresh)
        assert led.benched_for("w1", t) == 30.0 * 2 ** min(2 + i, 5)
    t = 1897.0 + 960.0
    # a completed lease clears its record: the next bench takes three failures again
    lease = led.issue("w1", 1, t + 1, policy_version=0, fresh=fresh)
    for p in lease.prompts:
        assert isinstance(led.accept(p.group_id, lease.lease_id, 0, 0), Accepted)
    assert led.workers["w1"].failed_leases == 0 and led.workers["w1"].benches == 0
    _fail(led, "w1", t + 2, fresh)
    _fail(led, "w1", t + 3, fresh)
    assert led.benched_for("w1", t + 3) == 0.0
    _fail(led, "w1", t + 4, fresh)
    assert led.benched_for("w1", t + 4) == 30.0


def test_one_bad_prompt_benches_nobody_and_is_abandoned_while_the_rest_flows():
    """A prompt that breaks sampling on every worker fails alone, goes to the worker it has
    not failed on first, and is abandoned after max_reissues; no worker is benched by it,
    though w1 fails on it twice in a row (the limit here is 2): it is in every failed lease."""
    led, fresh = _ledger(groups_per_step=8, max_reissues=3, worker_failure_limit=2), _fresh()
    for w in ("w1", "w2"):
        led.heartbeat(w, 0.0)
    first = led.issue("w1", 3, 0.0, policy_version=0, fresh=fresh)
    assert led.return_lease(first.lease_id, "w1", 0.0)  # e0:i0 is bad, e0:i1 and e0:i2 not
    workers, t = [], 1.0
    while led.states["abandoned"] == 0:
        for w in ("w2", "w1"):
            lease = led.issue(w, 3, t, policy_version=0, fresh=fresh)
            if lease is None:
                continue
            ids = [p.group_id for p in lease.prompts]
            if "e0:i0" in ids:
                assert ids == ["e0:i0"]
                workers.append(w)
                led.return_lease(lease.lease_id, w, t)
            else:
                for gid in ids:
                    assert isinstance(led.accept(gid, lease.lease_id, 0, 0), Accepted)
            t += 1.0
    # tried on w2 first (w1 had failed on it), then wherever: 4 issues in all, then abandoned
    assert workers[0] == "w2" and len(workers) == 3
    assert led.groups["e0:i0"].state == "abandoned" and led.groups["e0:i0"].issues == 4
    while led.pending:  # the good groups of the first lease still go out, and succeed
        lease = led.issue("w2", 3, t, policy_version=0, fresh=fresh)
        for p in lease.prompts:
            assert isinstance(led.accept(p.group_id, lease.lease_id, 0, 0), Accepted)
    assert led.groups["e0:i1"].state == led.groups["e0:i2"].state == "accepted"
    assert led.counters["workers_benched"] == 0
