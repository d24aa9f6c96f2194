"""A rollout worker gives back a lease whose sampling failed (``LeaseReturn``): the trainer
issues its open groups again at once, under the same ``group_id``s, instead of waiting for
the lease's deadline; a return of a lease that is not open changes nothing; a worker whose
leases keep failing is benched (refused leases for a while)."""

from __future__ import annotations

import time

from omnirl.protocol import decode, encode
from omnirl.protocol.messages import Lease, LeaseRequest, LeaseReturn, Refusal
from omnirl.tools.status import format_status


def test_a_returned_lease_is_issued_again_at_once(null_server, no_model):
    server = null_server(no_model, "runtime.lease_timeout_s=300")
    led = server.ledger
    led.heartbeat("rollout-0", time.time())
    lease = led.issue("rollout-0", 2, time.time(), policy_version=0, fresh=server.prompts.next)
    ids = [p.group_id for p in lease.prompts]

    back = LeaseReturn(lease_id=lease.lease_id, worker_id="rollout-0", reason="OutOfMemoryError")
    server._on_control(b"peer", encode(back))
    assert lease.lease_id not in led.leases
    assert sorted(led.pending) == sorted(ids)
    assert led.counters["leases_returned"] == 1

    server._on_control(b"peer", encode(back))  # again: no longer open, nothing changes
    assert led.counters["leases_returned"] == 1 and sorted(led.pending) == sorted(ids)
    for gid in list(led.pending):  # the only worker: it gets them back, one lease each
        again = led.issue("rollout-0", 2, time.time(), policy_version=0, fresh=server.prompts.next)
        assert [p.group_id for p in again.prompts] == [gid]


def test_a_worker_whose_leases_keep_failing_is_refused_leases_for_a_while(null_server, no_model):
    server = null_server(
        no_model, "runtime.worker_failure_limit=2", "runtime.bench_s=60", "train.groups_per_step=8"
    )
    server.rewards["reward-0"] = "tcp://127.0.0.1:1"  # a reward worker is registered
    now = time.time()
    for w in ("rollout-0", "rollout-1"):
        server.ledger.heartbeat(w, now)
    failed = []
    for _ in range(2):  # two leases fail, on different groups
        lease = server._lease_for(LeaseRequest(worker_id="rollout-0"), time.time())
        assert isinstance(lease, Lease)
        failed += [p.group_id for p in lease.prompts]
        back = LeaseReturn(lease_id=lease.lease_id, worker_id="rollout-0", reason="CUDA error")
        server._on_control(b"peer", encode(back))
    assert len(set(failed)) == 2
    refusal = server._lease_for(LeaseRequest(worker_id="rollout-0"), time.time())
    assert isinstance(refusal, Refusal) and refusal.code == "no_work"
    assert "benched" in refusal.reason and "rollout-0" in refusal.reason
    assert 59 < refusal.retry_after_s <= 60  # the worker waits instead of polling
    status = server.status()
    assert status.counters["workers_benched"] == 1
    benched = {w.worker_id: w.benched_s for w in status.workers}
    assert 59 < benched["rollout-0"] <= 60 and benched["rollout-1"] == 0
    lines = format_status(decode(encode(status))).splitlines()  # as `omnirl status` shows it
    assert [x for x in lines if "benched " in x] == [x for x in lines if "rollout-0 " in x]
    # the rest of the fleet works on, on the failed groups first, one lease each
    for gid in failed:
        other = server._lease_for(LeaseRequest(worker_id="rollout-1", capacity=4), time.time())
        assert isinstance(other, Lease) and [p.group_id for p in other.prompts] == [gid]


def test_a_lease_refused_for_its_sampling_parameters_ends_the_run(null_server, no_model, caplog):
    """The model refuses the run's sampling parameters: no worker could sample any lease,
    so the trainer stops with exit code 2 and says why, instead of issuing it again."""
    server = null_server(no_model, "runtime.lease_timeout_s=300")
    led = server.ledger
    led.heartbeat("rollout-0", time.time())
    lease = led.issue("rollout-0", 2, time.time(), policy_version=0, fresh=server.prompts.next)
    reason = "SamplingError: height and width must be positive multiples of 16, got 500x512"
    back = LeaseReturn(
        lease_id=lease.lease_id, worker_id="rollout-0", reason=reason, bad_sampling=True
    )
    server._on_control(b"peer", encode(back))
    assert server.exit_code == 2 and server._stop_requested
    assert reason in server._stop_reason
    assert "change the run's sampling settings" in caplog.text
    assert led.counters["leases_returned"] == 1  # its groups are back, consistent for a resume
    assert not led.leases


def test_a_sampler_job_says_whether_it_failed_on_refused_sampling_parameters():
    from omnirl.models.sd3.sampling_rules import SamplingError
    from omnirl.rollout.sampler import JobResult

    assert JobResult("lease", False, error_type=SamplingError).bad_sampling
    assert not JobResult("lease", False, error_type=RuntimeError).bad_sampling  # e.g. CUDA
    assert not JobResult("lease", True).bad_sampling
