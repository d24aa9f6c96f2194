"""A rollout worker gives back a lease whose sampling failed (``LeaseReturn``): the trainer
issues its open groups again at once, under the same ``group_id``s, instead of waiting for
the lease's deadline; a return of a lease that is not open changes nothing."""

from __future__ import annotations

import time

from omnirl.protocol import encode
from omnirl.protocol.messages import LeaseReturn


class NoModel:
    architecture, model_path, sde_type = "Null", "", "sde"
    weight_format, adapter_config = "lora", {"r": 1}
    adapter = train_step = None

    def export_weights(self):
        return {}


def test_a_returned_lease_is_issued_again_at_once(null_server):
    server = null_server(NoModel(), "runtime.lease_timeout_s=300")
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
    again = led.issue("rollout-0", 2, time.time(), policy_version=0, fresh=server.prompts.next)
    assert sorted(p.group_id for p in again.prompts) == sorted(ids)
