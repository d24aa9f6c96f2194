"""Role sockets over real loopback sockets: delivery, bad input, size limits, send tracking."""

from __future__ import annotations

import pytest
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from omnirl.protocol.codec import encode
from omnirl.protocol.errors import (
    FrameCountMismatch,
    MalformedHeader,
    MessageTooLarge,
    ProtocolError,
    TruncatedHeader,
)
from omnirl.protocol.messages import (
    DiffusionTrajectoryGroup,
    Heartbeat,
    PromptSpec,
    SamplingParams,
)
from omnirl.protocol.sockets import (
    ROLES,
    SocketFactory,
    SocketOptions,
    bound_endpoint,
    recv_message,
    send_message,
)

TIMEOUT_MS = 2000


def make_group(latent_elems: int = 64, group_id: str = "g0") -> DiffusionTrajectoryGroup:
    """A small group: latents / next_latents float32 [2, 1, latent_elems], log_probs [2, 1]."""
    return DiffusionTrajectoryGroup(
        group_id=group_id,
        lease_id="l0",
        worker_id="w0",
        prompt=PromptSpec(group_id=group_id, text="a red square"),
        sampling=SamplingParams(group_size=2),
        policy_version=3,
        seeds=torch.tensor([1, 2], dtype=torch.int64),
        latents=torch.randn(2, 1, latent_elems),
        next_latents=torch.randn(2, 1, latent_elems),
        log_probs=torch.randn(2, 1),
    )


@pytest.fixture
def sockets():
    with SocketFactory(options=SocketOptions(linger_ms=0)) as factory:
        yield factory


def test_roles_name_socket_types(sockets):
    for role, (bind_type, connect_type) in ROLES.items():
        server = sockets.bind(role, "inproc://" + role)
        client = sockets.connect(role, "inproc://" + role)
        assert (server.type, client.type) == (bind_type, connect_type)
    with pytest.raises(ValueError, match="unknown socket role"):
        sockets.bind("nope", "inproc://nope")


def test_control_round_trip_over_tcp_with_identity(sockets):
    server = sockets.bind("control", "tcp://127.0.0.1:*")
    endpoint = bound_endpoint(server)
    assert endpoint.startswith("tcp://127.0.0.1:") and not endpoint.endswith(":*")
    client = sockets.connect("control", endpoint)
    group = make_group()
    send_message(client, group)
    got = recv_message(server, timeout_ms=TIMEOUT_MS)
    assert got.ok and got.identity
    msg = got.unwrap()
    assert isinstance(msg, DiffusionTrajectoryGroup)
    assert torch.equal(msg.latents, group.latents) and torch.equal(msg.seeds, group.seeds)
    assert got.nbytes == sum(len(f) for f in got.frames)
    # the reply reaches the sender through its identity
    send_message(server, Heartbeat(worker_id="trainer", role="trainer"), identity=got.identity)
    reply = recv_message(client, timeout_ms=TIMEOUT_MS).unwrap()
    assert isinstance(reply, Heartbeat) and reply.worker_id == "trainer"


def test_intake_push_pull_over_ipc_decodes_without_copy(sockets, tmp_path):
    pull = sockets.bind("intake", f"ipc://{tmp_path}/intake.sock")
    push = sockets.connect("intake", bound_endpoint(pull))
    send_message(push, make_group(latent_elems=1 << 15))  # 256 KiB per tensor: not copied
    got = recv_message(pull, timeout_ms=TIMEOUT_MS)
    assert got.identity is None
    msg = got.unwrap()
    frame_starts = [torch.frombuffer(f.buffer, dtype=torch.uint8).data_ptr() for f in got.frames]
    assert msg.latents.data_ptr() in frame_starts
    assert msg.next_latents.data_ptr() in frame_starts


def test_timeout_raises_timeout_error(sockets):
    pull = sockets.bind("intake", "inproc://quiet")
    with pytest.raises(TimeoutError, match="50 ms"):
        recv_message(pull, timeout_ms=50)


@pytest.mark.parametrize(
    ("frames", "error"),
    [
        ([b"\xc1\xc1\xc1"], MalformedHeader),
        ([b""], TruncatedHeader),
        ([b"\x82\xa4kind"], TruncatedHeader),
        (None, FrameCountMismatch),  # a good header with one tensor frame missing
    ],
)
def test_garbage_is_a_protocol_error_and_the_loop_goes_on(sockets, frames, error):
    server = sockets.bind("control", "tcp://127.0.0.1:*")
    client = sockets.connect("control", bound_endpoint(server))
    if frames is None:
        frames = [bytes(f) for f in encode(make_group())][:-1]
    client.send_multipart(frames)
    bad = recv_message(server, timeout_ms=TIMEOUT_MS)
    assert not bad.ok and isinstance(bad.error, error) and isinstance(bad.error, ProtocolError)
    assert bad.message is None and bad.identity
    with pytest.raises(error):
        bad.unwrap()
    # the refusal can go back to the peer, and the next good message still arrives
    send_message(server, bad.error.to_refusal(), identity=bad.identity)
    assert recv_message(client, timeout_ms=TIMEOUT_MS).unwrap().code == error.code
    send_message(client, Heartbeat(worker_id="w", role="rollout"))
    assert recv_message(server, timeout_ms=TIMEOUT_MS).ok


def test_oversized_frame_is_dropped_by_the_socket_and_the_server_keeps_going():
    limit = 1 << 20
    with SocketFactory(options=SocketOptions(max_bytes=limit, linger_ms=0)) as sockets:
        server = sockets.bind("control", "tcp://127.0.0.1:*")
        assert server.getsockopt(zmq.MAXMSGSIZE) == limit
        endpoint = bound_endpoint(server)
        big_sender = sockets.connect("control", endpoint)
        monitor = big_sender.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        good_sender = sockets.connect("control", endpoint)

        send_message(big_sender, make_group(latent_elems=(2 * limit) // 8))  # 2 MiB frames
        assert server.poll(300) == 0  # never delivered
        assert monitor.poll(TIMEOUT_MS), "the oversized sender was not disconnected"
        assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED

        send_message(good_sender, make_group(group_id="good"))
        got = recv_message(server, timeout_ms=TIMEOUT_MS)
        assert got.unwrap().group_id == "good"
        big_sender.disable_monitor()
        monitor.close(linger=0)


def test_many_frames_under_the_socket_limit_but_over_it_in_total_are_refused():
    limit = 1 << 20
    with SocketFactory(options=SocketOptions(max_bytes=limit, linger_ms=0)) as sockets:
        pull = sockets.bind("intake", "tcp://127.0.0.1:*")
        push = sockets.connect("intake", bound_endpoint(pull))
        send_message(push, make_group(latent_elems=(3 * limit) // 32))  # 2 x 0.75 MiB
        got = recv_message(pull, timeout_ms=TIMEOUT_MS)  # max_bytes: the socket's limit
        assert isinstance(got.error, MessageTooLarge) and got.error.limit == limit
        send_message(push, make_group(group_id="small"))
        assert recv_message(pull, timeout_ms=TIMEOUT_MS).unwrap().group_id == "small"


def test_track_waits_for_every_frame_not_only_the_last(sockets, tmp_path):
    address = f"ipc://{tmp_path}/late.sock"
    client = sockets.connect("control", address)  # nobody listens yet: frames stay queued
    group = make_group(latent_elems=1 << 16)  # big latents, small last frame (log_probs)
    tracker = send_message(client, group, track=True)
    assert not tracker.done, "a queued 512 KiB frame must keep the tracker pending"
    server = sockets.bind("control", address)
    got = recv_message(server, timeout_ms=TIMEOUT_MS)
    assert torch.equal(got.unwrap().latents, group.latents)
    tracker.wait(TIMEOUT_MS / 1000)
    assert tracker.done


def test_unsendable_message_raises_before_sending(sockets):
    pull = sockets.bind("intake", "inproc://nan")
    push = sockets.connect("intake", "inproc://nan")
    group = make_group()
    group.latents[0, 0, 0] = float("nan")
    with pytest.raises(ProtocolError, match="latents"):
        send_message(push, group)
    assert pull.poll(100) == 0


def test_router_send_to_unknown_peer_raises(sockets):
    server = sockets.bind("control", "tcp://127.0.0.1:*")
    with pytest.raises(zmq.ZMQError) as e:
        send_message(server, Heartbeat(worker_id="t", role="trainer"), identity=b"gone")
    assert e.value.errno == zmq.EHOSTUNREACH


def test_bind_failure_names_the_address(sockets):
    server = sockets.bind("intake", "tcp://127.0.0.1:*")
    with pytest.raises(zmq.ZMQError, match=r"cannot bind intake to tcp://127\.0\.0\.1:"):
        sockets.bind("intake", bound_endpoint(server))


def test_advertised_endpoint_replaces_only_what_a_peer_cannot_reach():
    import socket

    from omnirl.protocol.sockets import advertised_endpoint

    host = socket.gethostname()
    assert advertised_endpoint("tcp://127.0.0.1:5600") == "tcp://127.0.0.1:5600"
    assert advertised_endpoint("tcp://0.0.0.0:5600") == f"tcp://{host}:5600"
    assert advertised_endpoint("tcp://[::]:5600") == f"tcp://{host}:5600"
    assert advertised_endpoint("tcp://0.0.0.0:5600", "10.0.3.7") == "tcp://10.0.3.7:5600"
    assert advertised_endpoint("tcp://0.0.0.0:5600", "fd00::7") == "tcp://[fd00::7]:5600"
    assert advertised_endpoint("tcp://[::1]:5600") == "tcp://[::1]:5600"
    assert advertised_endpoint("ipc:///tmp/x.sock", "10.0.3.7") == "ipc:///tmp/x.sock"
