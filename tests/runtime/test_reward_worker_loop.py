"""The reward worker: scores only the images, forwards the other frames as received."""

from __future__ import annotations

import contextlib
import math
import threading
import time

import numpy as np
import pytest
import torch
import zmq
from fakes import FakeTrainer, make_group

from omnirl.protocol.auth import SecurityConfig, generate_keypair
from omnirl.protocol.codec import decode, encode
from omnirl.protocol.messages import DiffusionTrajectoryGroup, Heartbeat, Hello, Refusal
from omnirl.protocol.sockets import SocketFactory, SocketOptions
from omnirl.reward.scorers import jpeg_compressibility, register_scorer
from omnirl.reward.scoring import parse_scorer_spec
from omnirl.reward.worker import RewardWorker, RewardWorkerConfig


@register_scorer("test_nan")
def _nan_scorer(images, prompts=None):
    return [math.nan] * len(images)


@register_scorer("test_raises")
def _raising_scorer(images, prompts=None):
    raise RuntimeError("scorer exploded")


def _address(buffer) -> int:
    return np.frombuffer(buffer, dtype=np.uint8).ctypes.data


def _worker(spec: str = "jpeg_compressibility") -> RewardWorker:
    return RewardWorker(
        RewardWorkerConfig(trainer="tcp://127.0.0.1:1", scorers=parse_scorer_spec(spec))
    )


def _roundtrip(group) -> list[zmq.Frame]:
    """Send ``group`` through a real PUSH/PULL pair; the received zmq frames."""
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind("inproc://groups")
    push.connect("inproc://groups")
    push.send_multipart(encode(group), copy=False)
    frames = pull.recv_multipart(copy=False)
    push.close(0), pull.close(0)
    return frames  # the frames keep their memory alive without the context


def test_unread_tensor_frames_are_forwarded_as_the_received_buffers():
    group = make_group()
    received = _roundtrip(group)
    [out] = _worker().process(received)
    assert len(out) == len(received)
    in_addresses = {_address(f.buffer) for f in received[1:]}
    out_addresses = {_address(b) for b in out[1:]}
    assert out_addresses == in_addresses  # the very same memory: nothing copied or re-encoded
    scored = decode(out)
    assert isinstance(scored, DiffusionTrajectoryGroup)
    torch.testing.assert_close(scored.next_latents, group.next_latents, rtol=0, atol=0)
    torch.testing.assert_close(scored.log_probs, group.log_probs, rtol=0, atol=0)
    expected = jpeg_compressibility(group.images)
    assert scored.rewards.total == pytest.approx(expected)
    assert scored.rewards.components == {"jpeg_compressibility": pytest.approx(expected)}
    assert scored.rewards.weights == {"jpeg_compressibility": 1.0}
    assert scored.rewards.group_id == group.group_id
    assert "reward_s" in scored.timings


def test_weighted_components_are_named_and_summed():
    group = make_group()
    [out] = _worker("jpeg_compressibility:2,jpeg_incompressibility:0.5").process(encode(group))
    rewards = decode(out).rewards
    comp, incomp = (
        rewards.components[n] for n in ("jpeg_compressibility", "jpeg_incompressibility")
    )
    assert rewards.total == pytest.approx(
        [2 * a + 0.5 * b for a, b in zip(comp, incomp, strict=True)]
    )


@pytest.mark.parametrize(
    ("spec", "needle"), [("test_nan", "non-finite"), ("test_raises", "exploded")]
)
def test_a_failing_scorer_becomes_a_refusal_naming_the_group(spec, needle):
    worker = _worker(spec)
    [out] = worker.process(encode(make_group("e1:7")))
    refusal = decode(out)
    assert isinstance(refusal, Refusal)
    assert refusal.code == "reward_failed" and refusal.ref == "e1:7"
    assert needle in refusal.reason
    assert worker.counters.refused == 1 and worker.counters.scored == 0


def test_garbage_and_imageless_groups_never_crash_the_worker():
    worker = _worker()
    assert worker.process([b"\xc1garbage"]) == []
    assert worker.counters.malformed == 1
    group = make_group()
    group.images = None
    [out] = worker.process(encode(group))
    assert isinstance(decode(out), Refusal)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("scorer_from", "bind"),
    [("command_line", "loopback"), ("run_config", "loopback"), ("command_line", "wildcard")],
)
def test_reward_worker_process_loop_over_real_sockets(scorer_from, bind):
    """The scorer comes from the worker's own --scorer, or else from the run's config
    (``reward.scorer`` in the Welcome); both score the same. A worker bound to every
    interface (as on a cluster) gives its ``--advertise`` host in its Hello, not 0.0.0.0."""
    trainer = FakeTrainer()
    own = parse_scorer_spec("jpeg_incompressibility") if scorer_from == "command_line" else None
    run_config = {"reward": {"scorer": "jpeg_incompressibility" if own is None else "bogus"}}
    where = {}
    if bind == "wildcard":
        where = dict(
            bind="tcp://0.0.0.0:0", advertise="127.0.0.1", security=SecurityConfig(insecure=True)
        )
    worker = RewardWorker(
        RewardWorkerConfig(
            trainer=trainer.address(trainer.control), scorers=own, worker_id="reward-t", **where
        )
    )
    codes = []
    thread = threading.Thread(target=lambda: codes.append(worker.run()), daemon=True)
    thread.start()
    try:
        identity, hello = trainer.recv(trainer.control, kind=Hello)
        assert hello.role == "reward" and hello.address.startswith("tcp://127.0.0.1:")
        trainer.welcome(identity, hello.worker_id, config=run_config)
        _, beat = trainer.recv(trainer.control, kind=Heartbeat)
        assert beat.worker_id == "reward-t"
        push = trainer.ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(hello.address)
        groups = [make_group(f"e0:{i}", seed=i) for i in range(3)]
        for g in groups:
            push.send_multipart(encode(g), copy=False)
        push.send_multipart([b"not msgpack"])
        got = {}
        for _ in groups:
            _, scored = trainer.recv(trainer.intake, kind=DiffusionTrajectoryGroup)
            got[scored.group_id] = scored
        for g in groups:
            assert got[g.group_id].rewards.total == pytest.approx(
                [float(s) for s in _expected_sizes(g)]
            )
        trainer.send(trainer.control, identity, Refusal(code="shutdown", reason="done"))
        thread.join(10)
        assert codes == [0]
        assert worker.counters.scored == 3 and worker.counters.malformed == 1
        push.close(0)
    finally:
        worker.stop()
        thread.join(5)
        trainer.close()


@contextlib.contextmanager
def _curve_reward_worker(tmp_path, worker_id: str):
    """A reward worker with every socket CurveZMQ, as on a cluster, welcomed by a fake
    trainer: ``(trainer, worker, control identity, the rollout's PUSH to it, the keys dir,
    the worker's exit codes)``."""
    keys = tmp_path / "keys"
    for name in ("trainer", "reward", "rollout"):
        generate_keypair(keys, name)
    options = SocketOptions(linger_ms=0)
    trainer = FakeTrainer(
        sockets=SocketFactory(SecurityConfig(keys_dir=keys, name="trainer"), options)
    )
    security = SecurityConfig(keys_dir=keys, name="reward", server_key=keys / "trainer.key")
    worker = RewardWorker(
        RewardWorkerConfig(
            trainer=trainer.address(trainer.control),
            scorers=parse_scorer_spec("jpeg_incompressibility"),
            worker_id=worker_id,
            security=security,
        )
    )
    rollout_side = SocketFactory(
        SecurityConfig(keys_dir=keys, name="rollout", server_key=keys / "reward.key"), options
    )
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(worker.run()), daemon=True)
    thread.start()
    try:
        identity, hello = trainer.recv(trainer.control, kind=Hello)
        trainer.welcome(identity, hello.worker_id)
        push = rollout_side.connect("reward", hello.address)
        yield trainer, worker, identity, push, keys, codes
        trainer.send(trainer.control, identity, Refusal(code="shutdown", reason="done"))
        thread.join(10)
    finally:
        worker.stop()
        thread.join(5)
        rollout_side.close()
        trainer.close()


@pytest.mark.timeout(60)
def test_reward_worker_keeps_heartbeating_over_curve(tmp_path):
    """The ZMTP heartbeat (every 2 s) of the client connected to the PULL wakes the
    worker's poll once with no message behind it; the worker used to block in that receive
    and stop heartbeating until a group came (none does while the trainer counts it lost).
    It must go on heartbeating, then score."""
    with _curve_reward_worker(tmp_path, "reward-c") as (trainer, worker, _, push, _, codes):
        connected = time.monotonic()
        last_beat = 0.0
        while time.monotonic() - connected < 3.5:  # past the first ZMTP heartbeat
            trainer.recv(trainer.control, timeout_s=2.0, kind=Heartbeat)
            last_beat = time.monotonic()
        assert last_beat - connected > 3.0
        push.send_multipart(encode(make_group("e0:0")), copy=False)
        _, scored = trainer.recv(trainer.intake, kind=DiffusionTrajectoryGroup)
        assert scored.group_id == "e0:0" and worker.counters.scored == 1
    assert codes == [0]


@pytest.mark.timeout(60)
def test_reward_worker_drops_groups_of_a_key_revoked_while_connected(tmp_path, caplog):
    """The rollout's connection was let in before its key left the allow-list; CURVE keeps
    it up, so the worker must refuse what still comes over it, and score again once the
    key is back."""
    with _curve_reward_worker(tmp_path, "reward-r") as (trainer, worker, _, push, keys, codes):
        push.send_multipart(encode(make_group("e0:0")), copy=False)
        trainer.recv(trainer.intake, kind=DiffusionTrajectoryGroup)
        (keys / "rollout.key").rename(tmp_path / "rollout.key")  # revoked
        time.sleep(1.1)  # the allow-list is looked at again at most once a second
        push.send_multipart(encode(make_group("e0:1")), copy=False)
        deadline = time.monotonic() + 5
        while worker.counters.revoked == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert worker.counters.revoked == 1 and worker.counters.scored == 1
        assert "no longer in the allow-list" in caplog.text
        (tmp_path / "rollout.key").rename(keys / "rollout.key")  # granted again
        time.sleep(1.1)
        push.send_multipart(encode(make_group("e0:2")), copy=False)
        _, scored = trainer.recv(trainer.intake, kind=DiffusionTrajectoryGroup)
        assert scored.group_id == "e0:2" and worker.counters.scored == 2
    assert codes == [0]


def _expected_sizes(group):
    from omnirl.reward.scorers import jpeg_incompressibility

    return jpeg_incompressibility(group.images)


@pytest.mark.timeout(60)
def test_an_unknown_run_scorer_stops_the_worker_with_a_clear_error(caplog):
    trainer = FakeTrainer()
    worker = RewardWorker(
        RewardWorkerConfig(trainer=trainer.address(trainer.control), worker_id="reward-t")
    )
    codes = []
    thread = threading.Thread(target=lambda: codes.append(worker.run()), daemon=True)
    thread.start()
    try:
        identity, hello = trainer.recv(trainer.control, kind=Hello)
        trainer.welcome(identity, hello.worker_id, config={"reward": {"scorer": "no_such"}})
        thread.join(10)
        assert codes == [1]
        assert "no_such" in caplog.text and "reward.scorer" in caplog.text
    finally:
        worker.stop()
        thread.join(5)
        trainer.close()
