"""The trainer server on loopback with a model-free backend and hand-driven workers:
handshake, leases, intake exactly-once, bad input, version pushes, status, shutdown, resume."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch
import zmq

from omnirl.protocol.codec import decode, encode
from omnirl.protocol.messages import (
    Ack,
    DiffusionTrajectoryGroup,
    Heartbeat,
    Hello,
    Lease,
    LeaseRequest,
    Refusal,
    Rewards,
    Status,
    StatusRequest,
    WeightRequest,
    Welcome,
)
from omnirl.protocol.weights import WeightAssembler
from omnirl.trainer.balanced_data import BalancedPromptSource
from omnirl.trainer.config import load_config
from omnirl.trainer.server import ADDRESS_FILE, TrainerServer


class NullBackend:
    """Trains nothing; its 'weights' are the version number, so pushes are checkable."""

    architecture, model_path, sde_type = "Null", "", "sde"
    weight_format, adapter_config = "lora", {"r": 1}
    adapter = train_step = None

    def __init__(self):
        self.steps = 0
        self.lr_scales = []

    def export_weights(self):
        return {"w": torch.full((4,), float(self.steps))}

    def step(self, groups, *, policy_version, lr_scale=1.0):
        time.sleep(0.05)
        self.steps += 1
        self.lr_scales.append(lr_scale)
        return {"loss": 0.5, "groups": float(len(groups))}


def _config(tmp_path, *extra):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"prompt": f"p{i}", "metadata": {"category": "ab"[i % 2]}}) + "\n"
            for i in range(5)
        )
    )
    return load_config(
        None,
        [
            "model.path=unused",
            f"data.prompts={prompts}",
            "data.group_size=2",
            f"run.output_dir={tmp_path / 'run'}",
            "runtime.control_port=0",
            "runtime.heartbeat_timeout_s=5",
            "runtime.shutdown_grace_s=0.3",
            "train.groups_per_step=2",
            "logging.tensorboard=false",
            "logging.progress_bar=false",
            "checkpoint.every=1",
            "max_steps=2",
            *extra,
        ],
    )


class Peer:
    """One DEALER (or PUSH) on loopback that speaks through the real codec."""

    def __init__(self, ctx, kind, address):
        self.sock = ctx.socket(kind)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def send(self, msg):
        self.sock.send_multipart(encode(msg), copy=False)

    def recv(self, timeout=5.0):
        assert self.sock.poll(int(timeout * 1000)), "no reply from the trainer"
        return decode(self.sock.recv_multipart(copy=False))

    def ask(self, msg):
        self.send(msg)
        return self.recv()


def _scored(lease: Lease, prompt, reward=1.0):
    g = lease.sampling.group_size
    return DiffusionTrajectoryGroup(
        group_id=prompt.group_id,
        lease_id=lease.lease_id,
        worker_id=lease.worker_id,
        prompt=prompt,
        sampling=lease.sampling,
        policy_version=lease.policy_version,
        seeds=torch.arange(g, dtype=torch.int64),
        images=torch.full((g, 8, 8, 3), 200, dtype=torch.uint8),
        rewards=Rewards(
            group_id=prompt.group_id,
            total=[reward] * g,
            components={"a": [reward] * g, "b": [0.5] * g},
            weights={"a": 1.0, "b": 0.0},
        ),
    )


def _start(cfg, backend, resume=False):
    server = TrainerServer(cfg, backend, resume=resume)
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("rc", server.run()), daemon=True)
    thread.start()
    addr_file = cfg.run.output_dir + "/" + ADDRESS_FILE
    for _ in range(200):
        try:
            with open(addr_file) as fh:
                address = fh.read().strip()
            if address:
                return server, thread, result, address
        except FileNotFoundError:
            time.sleep(0.05)
    raise AssertionError("trainer.addr was not written")


def _collect_version(weights: Peer, timeout=5.0):
    asm = WeightAssembler()
    while True:
        msg = weights.recv(timeout)
        if isinstance(msg, Ack):
            return None
        done = asm.add(msg)
        if done is not None:
            return done


@pytest.mark.timeout(60)
def test_server_round_trip_with_bad_input_duplicates_pushes_and_shutdown(tmp_path):
    cfg = _config(
        tmp_path,
        "logging.tensorboard=true",
        "logging.image_grid_every=1",
        "train.lr_schedule=linear",
        "train.lr_min_ratio=0.2",
        "train.lr_warmup_steps=2",
    )
    backend = NullBackend()
    server, thread, result, address = _start(cfg, backend)
    ctx = zmq.Context()
    try:
        control = Peer(ctx, zmq.DEALER, address)
        reward = Peer(ctx, zmq.DEALER, address)
        # a lease before any Hello: told to register
        assert control.ask(LeaseRequest(worker_id="r1")).code == "unknown_worker"
        # garbage on control is refused with a typed code, and the server lives on
        control.sock.send_multipart([b"\xc1garbage"])
        assert isinstance(control.recv(), Refusal)
        welcome = reward.ask(Hello(role="reward", worker_id="s1", address="tcp://127.0.0.1:9"))
        assert isinstance(welcome, Welcome)
        welcome = control.ask(Hello(role="rollout", worker_id="r1"))
        assert isinstance(welcome, Welcome) and welcome.policy_version == 0
        assert welcome.topology.reward == ["tcp://127.0.0.1:9"]
        assert welcome.config["data"]["group_size"] == 2
        weights = Peer(ctx, zmq.DEALER, welcome.topology.weights)
        intake = Peer(ctx, zmq.PUSH, welcome.topology.intake)
        weights.send(WeightRequest(worker_id="r1", have_version=-1))
        v0 = _collect_version(weights)
        assert v0.version == 0 and torch.equal(v0.tensors["w"], torch.zeros(4))
        assert v0.adapter_config == {"r": 1}

        lease = control.ask(LeaseRequest(worker_id="r1", capacity=5))
        assert isinstance(lease, Lease) and len(lease.prompts) == 1  # prompts_per_lease
        assert lease.reward_address == "tcp://127.0.0.1:9"
        second = control.ask(LeaseRequest(worker_id="r1"))
        assert control.ask(LeaseRequest(worker_id="r1")).code == "no_work"  # sync budget: 2
        intake.sock.send_multipart([b"not a message"])  # rejected, counted
        intake.send(_scored(lease, lease.prompts[0]))
        intake.send(_scored(lease, lease.prompts[0]))  # duplicate
        unscored = _scored(second, second.prompts[0])
        unscored.rewards = None
        intake.send(unscored)  # rejected: no rewards
        intake.send(_scored(second, second.prompts[0]))
        v1 = _collect_version(weights)  # pushed without asking
        assert v1.version == 1 and torch.equal(v1.tensors["w"], torch.ones(4))

        control.send(Heartbeat(worker_id="r1", role="rollout", policy_version=1))
        status = control.ask(StatusRequest())
        assert isinstance(status, Status) and status.policy_version == 1 and status.step == 1
        assert {w.worker_id for w in status.workers} == {"r1", "s1"}
        assert status.counters["groups_duplicate"] == 1
        assert status.counters["rejected_unscored"] == 1
        assert sum(v for k, v in status.counters.items() if k.startswith("rejected_")) == 2

        for _ in range(2):  # step 2 at version 1
            lease = control.ask(LeaseRequest(worker_id="r1"))
            assert lease.policy_version == 1
            intake.send(_scored(lease, lease.prompts[0]))
        assert _collect_version(weights).version == 2
        deadline = time.time() + 10
        reply = control.ask(LeaseRequest(worker_id="r1"))
        while reply.code != "shutdown" and time.time() < deadline:
            time.sleep(0.05)
            reply = control.ask(LeaseRequest(worker_id="r1"))
        assert reply.code == "shutdown"
        thread.join(10)
        assert result.get("rc") == 0
        # linear over max_steps=2 to 0.2, times the warm-up's 1/2 on the first step
        assert backend.lr_scales == pytest.approx([0.5, 0.6])
        lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(x)["step"] for x in lines] == [1, 2]
        first = json.loads(lines[0])
        assert first["policy_version"] == 1
        assert first["reward/a"] == 1.0 and first["reward/b"] == 0.5  # each component logged
        assert first["elapsed_s"] > 0
        assert list((tmp_path / "run" / "tb").glob("events.out.tfevents.*"))
        assert (tmp_path / "run" / "images" / "step_000001.png").is_file()
        assert (tmp_path / "run" / "checkpoints" / "step_00000002" / "state.pt").is_file()
    finally:
        server.request_stop()
        thread.join(10)
        ctx.destroy(linger=0)


def _run_one_step_and_stop(tmp_path, *extra: str) -> tuple[list[str], Path, dict]:
    """A run of ``max_steps=1`` (and ``extra`` overrides) over the wire, stopped: the group
    ids it leased, its step-1 checkpoint's ``state.pt`` and what that holds (the address file
    removed, for a resume)."""
    cfg = _config(tmp_path, "max_steps=1", *extra)
    server, thread, result, address = _start(cfg, NullBackend())
    ctx = zmq.Context()
    seen = []
    try:
        Peer(ctx, zmq.DEALER, address).ask(
            Hello(role="reward", worker_id="s", address="tcp://127.0.0.1:9")
        )
        control = Peer(ctx, zmq.DEALER, address)
        intake = Peer(
            ctx, zmq.PUSH, control.ask(Hello(role="rollout", worker_id="r")).topology.intake
        )
        for _ in range(2):
            lease = control.ask(LeaseRequest(worker_id="r"))
            seen.append(lease.prompts[0].group_id)
            intake.send(_scored(lease, lease.prompts[0]))
        thread.join(10)
        assert result.get("rc") == 0
    finally:
        server.request_stop()
        thread.join(10)
        ctx.destroy(linger=0)
    (tmp_path / "run" / ADDRESS_FILE).unlink()
    state_file = tmp_path / "run" / "checkpoints" / "step_00000001" / "state.pt"
    return seen, state_file, torch.load(state_file)


@pytest.mark.timeout(60)
def test_resumed_run_with_its_minutes_spent_stops_without_training(tmp_path):
    _, state_file, saved = _run_one_step_and_stop(tmp_path)
    torch.save({**saved, "elapsed_s": 61.0}, state_file)  # a 1-minute run, already over
    server, thread, result, _ = _start(
        _config(tmp_path, "max_steps=5", "max_minutes=1"), NullBackend(), resume=True
    )
    try:
        thread.join(10)
        assert not thread.is_alive() and result.get("rc") == 0
        assert server.step == 1  # no new step: the budget was spent before the restart
    finally:
        server.request_stop()
        thread.join(10)


@pytest.mark.timeout(60)
def test_resume_continues_version_and_data_order(tmp_path):
    seen, state_file, saved = _run_one_step_and_stop(tmp_path)
    assert saved["elapsed_s"] > 0.05  # at least the one step's sleep
    # 10 more minutes on the recorded clock: only a restored clock can read above them
    torch.save({**saved, "elapsed_s": saved["elapsed_s"] + 600.0}, state_file)
    cfg2 = _config(tmp_path, "max_steps=2", "max_minutes=60")
    server, thread, _, address = _start(cfg2, NullBackend(), resume=True)
    ctx = zmq.Context()
    try:
        assert server.version == 1 and server.step == 1
        # the run's clock goes on from the checkpoint (max_minutes, lr schedule), not from 0
        assert server.elapsed_s >= saved["elapsed_s"] + 600.0
        control = Peer(ctx, zmq.DEALER, address)
        Peer(ctx, zmq.DEALER, address).ask(
            Hello(role="reward", worker_id="s", address="tcp://127.0.0.1:9")
        )
        assert control.ask(Hello(role="rollout", worker_id="r")).policy_version == 1
        lease = control.ask(LeaseRequest(worker_id="r"))
        straight = [p.group_id for p in server.prompts.__class__.from_config(cfg2.data).take(3)]
        assert [*seen, lease.prompts[0].group_id] == straight
    finally:
        server.request_stop()
        thread.join(10)
        ctx.destroy(linger=0)


@pytest.mark.timeout(60)
def test_balanced_prompts_hear_every_accepted_group_and_resume_with_it(tmp_path):
    _, _, saved = _run_one_step_and_stop(tmp_path, "data.balance_by=category")
    strata = saved["data"]["strata"]
    assert set(strata) == {"a", "b"}
    # both groups scored 1.0 on every sample: two tied groups reported, no spread
    assert sorted(o for s in strata.values() for o in s["outcomes"]) == [False, False]
    cfg2 = _config(tmp_path, "max_steps=2", "data.balance_by=category")
    server, thread, _, _ = _start(cfg2, NullBackend(), resume=True)
    try:
        assert isinstance(server.prompts, BalancedPromptSource)
        assert server.prompts.state_dict()["strata"] == strata
        assert min(server.prompts.weights().values()) < 0.5  # a tied stratum weighs less
    finally:
        server.request_stop()
        thread.join(10)


class DivergingBackend(NullBackend):
    """Its first step leaves a NaN in the policy."""

    def export_weights(self):
        w = torch.full((4,), float(self.steps))
        if self.steps:
            w[2] = float("nan")
        return {"w": w}


@pytest.mark.timeout(60)
def test_a_non_finite_policy_stops_the_run_without_publishing_or_checkpointing_it(tmp_path):
    cfg = _config(tmp_path)
    server, thread, result, address = _start(cfg, DivergingBackend())
    ctx = zmq.Context()
    try:
        control = Peer(ctx, zmq.DEALER, address)
        reward = Peer(ctx, zmq.DEALER, address)
        reward.ask(Hello(role="reward", worker_id="s1", address="tcp://127.0.0.1:9"))
        welcome = control.ask(Hello(role="rollout", worker_id="r1"))
        intake = Peer(ctx, zmq.PUSH, welcome.topology.intake)
        for _ in range(2):
            lease = control.ask(LeaseRequest(worker_id="r1"))
            assert isinstance(lease, Lease), lease
            intake.send(_scored(lease, lease.prompts[0]))
        thread.join(20)
        assert not thread.is_alive() and result["rc"] == 1
        assert server.publisher.version == 0  # the NaN version never went out
        assert not list((tmp_path / "run").glob("checkpoints/step_*"))
    finally:
        server.request_stop()
        thread.join(10)
        ctx.destroy(linger=0)


@pytest.mark.timeout(60)
def test_a_worker_whose_key_is_revoked_while_connected_gets_nothing_more_through(tmp_path):
    """Every socket CurveZMQ. The worker's connection was let in at its handshake and CURVE
    keeps it up after its key leaves the allow-list; the trainer drops what still comes over
    it (a Heartbeat, a LeaseRequest: no reply), counts and names it, and answers again once
    the key is back. A worker silent to the trainer is declared lost and its leases reissued,
    as a dead one's would be."""
    from omnirl.protocol.auth import SecurityConfig, generate_keypair
    from omnirl.protocol.sockets import SocketFactory, SocketOptions

    keys = tmp_path / "keys"
    for name in ("trainer", "rollout"):
        generate_keypair(keys, name)
    cfg = _config(tmp_path, f"runtime.keys_dir={keys}")
    server, thread, _, address = _start(cfg, NullBackend())
    client = SocketFactory(
        SecurityConfig(keys_dir=keys, name="rollout", server_key=keys / "trainer.key"),
        SocketOptions(linger_ms=0),
    )

    def ask(sock, msg, timeout_s=5.0):
        sock.send_multipart(encode(msg), copy=False)
        if not sock.poll(int(timeout_s * 1000)):
            return None
        return decode(sock.recv_multipart(copy=False))

    try:
        control = client.connect("control", address)
        assert isinstance(ask(control, Hello(role="rollout", worker_id="r1")), Welcome)
        (keys / "rollout.key").rename(tmp_path / "rollout.key")  # revoked
        time.sleep(1.1)  # the allow-list is looked at again at most once a second
        assert ask(control, LeaseRequest(worker_id="r1"), timeout_s=1.5) is None
        assert server.counters["messages_revoked"] >= 1
        (tmp_path / "rollout.key").rename(keys / "rollout.key")  # granted again
        time.sleep(1.1)
        assert isinstance(ask(control, LeaseRequest(worker_id="r1")), (Lease, Refusal))
    finally:
        server.request_stop()
        thread.join(10)
        client.close()
