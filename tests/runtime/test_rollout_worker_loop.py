"""The rollout worker's loop against a stand-in trainer, with a stand-in model adapter.

Real sockets on loopback and the real codec; the adapter records when weights are applied
and when sampling runs, so the test can see that a version changes only between leases.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
import zmq
from fakes import FakeTrainer

from omnirl.models.registry import discover, register_rollout_adapter
from omnirl.protocol.messages import (
    DiffusionTrajectoryGroup,
    Heartbeat,
    Hello,
    Lease,
    LeaseRequest,
    LeaseReturn,
    PromptSpec,
    Refusal,
    SamplingParams,
    WeightRequest,
)
from omnirl.protocol.weights import split_update
from omnirl.rollout.worker import RolloutWorker, RolloutWorkerConfig

EVENTS: list[tuple] = []


@register_rollout_adapter("FakeTestPipeline")
class FakeAdapter:
    """Images are filled with the held weight's value; sampling takes 0.6 s."""

    def __init__(self, lora):
        self.lora = lora
        self.weight = None
        self.sampling = False

    @classmethod
    def from_pretrained(cls, path, *, device, dtype, lora):
        EVENTS.append(("build", lora))
        return cls(lora)

    def load_weights(self, format, tensors):
        assert not self.sampling, "weights applied inside a lease"
        self.weight = float(tensors["w"][0]) + float(tensors["b"].sum())
        EVENTS.append(("apply", self.weight))

    def sample(self, prompts, sampling, *, lease_id, worker_id, policy_version):
        self.sampling = True
        EVENTS.append(("sample", lease_id, policy_version, self.weight))
        time.sleep(0.6)
        self.sampling = False
        if prompts[0].text == "fail":
            raise RuntimeError("the sampler failed")
        g = sampling.group_size
        return [
            DiffusionTrajectoryGroup(
                group_id=p.group_id,
                lease_id=lease_id,
                worker_id=worker_id,
                prompt=p,
                sampling=sampling,
                policy_version=policy_version,
                seeds=torch.arange(g),
                images=torch.full((g, 8, 8, 3), int(self.weight), dtype=torch.uint8),
            )
            for p in prompts
        ]


def _publish(trainer, identity, version, value):
    tensors = {"w": torch.tensor([float(value)]), "b": torch.zeros(64)}
    for chunk in split_update(version, "lora", tensors, chunk_bytes=16, adapter_config={"r": 2}):
        trainer.send(trainer.weights, identity, chunk)


def _lease(n, version, deadline=60.0, text="p"):
    return Lease(
        lease_id=f"L{n}",
        worker_id="rollout-t",
        policy_version=version,
        deadline=time.time() + deadline,
        prompts=[PromptSpec(group_id=f"e0:{n}", text=text)],
        sampling=SamplingParams(group_size=2),
    )


@pytest.mark.timeout(240)
def test_rollout_worker_versions_leases_and_heartbeats(caplog):
    caplog.set_level("WARNING", logger="omnirl.rollout")
    EVENTS.clear()
    discover()  # import the model families now (diffusers is slow to import), not mid-test
    trainer = FakeTrainer()
    groups_in = trainer.ctx.socket(zmq.PULL)
    groups_in.setsockopt(zmq.LINGER, 0)
    groups_in.bind("tcp://127.0.0.1:*")
    reward_address = trainer.address(groups_in)
    worker = RolloutWorker(
        RolloutWorkerConfig(
            trainer=trainer.address(trainer.control), worker_id="rollout-t", retry_s=1.0
        )
    )
    codes = []
    thread = threading.Thread(target=lambda: codes.append(worker.run()), daemon=True)
    thread.start()
    beats: list[Heartbeat] = []

    def control(kind, timeout_s=20.0):
        deadline = time.monotonic() + timeout_s
        while True:
            ident, msg = trainer.recv(trainer.control, max(0.1, deadline - time.monotonic()))
            if isinstance(msg, Heartbeat):
                beats.append(msg)
            if isinstance(msg, kind):
                return ident, msg

    try:
        ident, hello = control(Hello)
        assert hello.role == "rollout"
        trainer.welcome(
            ident,
            "rollout-t",
            reward=[reward_address],
            model_path="/none",
            architecture="FakeTestPipeline",
            config={"algorithm": {"name": "flow_grpo"}},
        )
        w_ident, request = trainer.recv(trainer.weights, kind=WeightRequest)
        assert request.have_version == -1
        # No lease is asked for before a version is held (late joiners included).
        with pytest.raises(TimeoutError):
            control(LeaseRequest, timeout_s=1.0)
        _publish(trainer, w_ident, 0, 10)
        control(LeaseRequest)
        assert EVENTS[:2] == [("build", {"r": 2}), ("apply", 10.0)]
        trainer.send(trainer.control, ident, _lease(1, 0))
        time.sleep(0.2)  # sampling lease 1 now; version 1 arrives in the middle of it
        _publish(trainer, w_ident, 1, 20)
        _, group = trainer.recv(groups_in, kind=DiffusionTrajectoryGroup)
        assert (group.group_id, group.policy_version, int(group.images[0, 0, 0, 0])) == (
            "e0:1",
            0,
            10,
        )
        # The next lease is asked for only once L1 is done, so every heartbeat sent while it
        # was sampled (0.6 s, a beat every 0.2 s) is read by the time that request arrives.
        control(LeaseRequest)
        assert any("L1" in b.leases for b in beats), [b.leases for b in beats]
        # A lease needing version 2 waits until version 2 has arrived whole.
        trainer.send(trainer.control, ident, _lease(2, 2))
        time.sleep(0.5)
        assert not groups_in.poll(0)
        _publish(trainer, w_ident, 2, 30)
        _, group = trainer.recv(groups_in, kind=DiffusionTrajectoryGroup)
        assert (group.group_id, group.policy_version, int(group.images[0, 0, 0, 0])) == (
            "e0:2",
            2,
            30,
        )
        assert [e for e in EVENTS if e[0] == "sample"] == [
            ("sample", "L1", 0, 10.0),
            ("sample", "L2", 2, 30.0),
        ]
        control(LeaseRequest)
        # A lease whose sampling fails is given back at once (its groups are issued again
        # now, not at its deadline), and the worker goes on asking for work.
        trainer.send(trainer.control, ident, _lease(3, 2, text="fail"))
        _, returned = control(LeaseReturn)
        assert returned.lease_id == "L3" and returned.worker_id == "rollout-t"
        assert "RuntimeError: the sampler failed" in returned.reason
        control(LeaseRequest)
        trainer.send(trainer.control, ident, Refusal(code="no_work", reason="wait"))
        control(LeaseRequest)  # asks again after a short back-off
        # A bench: the worker waits as long as the refusal says, heartbeating meanwhile, and
        # says so in its log.
        bench = Refusal(code="no_work", reason="benched for 2 s", retry_after_s=2.0)
        trainer.send(trainer.control, ident, bench)
        sent = time.monotonic()
        beats.clear()
        control(LeaseRequest)
        assert time.monotonic() - sent > 1.8
        assert len(beats) >= 5  # every 0.2 s
        assert any("no leases for 2 s: benched for 2 s" in r.getMessage() for r in caplog.records)
        _, beat = control(Heartbeat)
        assert beat.policy_version == 2 and beat.stats["weights_version"] == 2.0
        assert beat.stats["leases_done"] == 2.0 and beat.stats["weights_digest"] > 0
        assert beat.stats["leases_failed"] == 1.0
        trainer.send(trainer.control, ident, Refusal(code="shutdown", reason="done"))
        thread.join(10)
        assert codes == [0]
    finally:
        worker.stop()
        thread.join(5)
        groups_in.close(0)
        trainer.close()


@pytest.mark.timeout(60)
def test_rollout_worker_exits_when_the_trainer_never_answers():
    worker = RolloutWorker(RolloutWorkerConfig(trainer="tcp://127.0.0.1:9", trainer_timeout_s=1.0))
    t0 = time.monotonic()
    assert worker.run() == 2
    assert time.monotonic() - t0 < 10
