"""CurveZMQ over real tcp sockets: allowed keys deliver, unknown keys deliver nothing."""

from __future__ import annotations

import contextlib
import logging
import shutil
import socket
import time

import pytest
import zmq

from omnirl.protocol.auth import InsecureEndpointError, SecurityConfig, generate_keypair
from omnirl.protocol.messages import Heartbeat
from omnirl.protocol.sockets import (
    SocketFactory,
    SocketOptions,
    bound_endpoint,
    recv_message,
    recv_ready,
    send_message,
)

TIMEOUT_MS = 2000
NOTHING_MS = 400  # how long "nothing arrives" is watched
OPTIONS = SocketOptions(linger_ms=0)


def heartbeat(worker_id: str) -> Heartbeat:
    return Heartbeat(worker_id=worker_id, role="rollout")


@pytest.fixture
def keys(tmp_path):
    """server + allowed client keys in ``allowed/``; an intruder's keys elsewhere."""
    allowed = tmp_path / "allowed"
    generate_keypair(allowed, "trainer")
    generate_keypair(allowed, "rollout-0")
    generate_keypair(tmp_path / "intruder", "rollout-9")
    return tmp_path


def server_factory(keys, **kw) -> SocketFactory:
    cfg = SecurityConfig(keys_dir=keys / "allowed", name="trainer", **kw)
    return SocketFactory(cfg, OPTIONS)


def client_factory(keys, folder: str, name: str) -> SocketFactory:
    cfg = SecurityConfig(keys_dir=keys / folder, name=name, server_key=keys / "allowed/trainer.key")
    return SocketFactory(cfg, OPTIONS)


def send_if_possible(sock: zmq.Socket, msg: Heartbeat) -> None:
    """Send without blocking: a client whose handshake failed may have no pipe to queue on.

    libzmq drops the connection's pipe once the server denies the handshake, so a blocking
    send from a rejected client would wait forever (real clients use a send timeout).
    """
    with contextlib.suppress(zmq.Again):
        send_message(sock, msg, flags=zmq.NOBLOCK)


def non_loopback_ip() -> str | None:
    """This machine's address on its default route, if it has one (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))
            ip = s.getsockname()[0]
    except OSError:
        return None
    return None if ip.startswith("127.") else ip


def test_allowed_key_delivers_and_unknown_key_delivers_nothing(keys, caplog):
    caplog.set_level(logging.WARNING, logger="omnirl.protocol.auth")
    with (
        server_factory(keys) as server_side,
        client_factory(keys, "allowed", "rollout-0") as good_side,
        client_factory(keys, "intruder", "rollout-9") as bad_side,
    ):
        server = server_side.bind("control", "tcp://127.0.0.1:*")
        endpoint = bound_endpoint(server)

        intruder = bad_side.connect("control", endpoint)
        send_if_possible(intruder, heartbeat("intruder"))
        assert server.poll(NOTHING_MS) == 0, "a message from an unknown key arrived"

        good = good_side.connect("control", endpoint)
        send_message(good, heartbeat("rollout-0"))
        got = recv_message(server, timeout_ms=TIMEOUT_MS)
        assert got.unwrap().worker_id == "rollout-0"
        # encrypted both ways: the reply reaches the allowed client
        send_message(server, heartbeat("trainer"), identity=got.identity)
        assert recv_message(good, timeout_ms=TIMEOUT_MS).unwrap().worker_id == "trainer"

        assert server.poll(NOTHING_MS) == 0  # the intruder's message never comes later
        auth = server_side.authenticator
        assert auth is not None and auth.denied >= 1 and auth.allowed >= 1
    denials = [r for r in caplog.records if "denied" in r.getMessage()]
    assert denials and "is not in" in denials[0].getMessage()


@pytest.mark.timeout(30)
def test_a_poll_woken_by_a_curve_heartbeat_never_blocks_a_receive(keys):
    """libzmq reports POLLIN on a CURVE socket once at the first ZMTP heartbeat, with no
    message behind it. A receive after a poll must not wait for the next real message
    (a reward worker stopped heartbeating that way): ``recv_ready`` gives None and
    ``recv_message`` keeps its deadline."""
    fast = SocketOptions(linger_ms=0, heartbeat_ivl_ms=50, heartbeat_timeout_ms=1000)
    server_cfg = SecurityConfig(keys_dir=keys / "allowed", name="trainer")
    client_cfg = SecurityConfig(
        keys_dir=keys / "allowed", name="rollout-0", server_key=keys / "allowed/trainer.key"
    )
    with SocketFactory(server_cfg, fast) as server_side, SocketFactory(client_cfg, fast) as client:
        pull = server_side.bind("reward", "tcp://127.0.0.1:*")
        client.connect("reward", bound_endpoint(pull))
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            recv_message(pull, timeout_ms=1500)  # the heartbeat's POLLIN comes within it
        assert time.monotonic() - t0 < 5
        client.connect("reward", bound_endpoint(pull))  # a second connection, a second wake
        wakes = 0
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            if pull.poll(20):
                wakes += 1
                assert recv_ready(pull) is None  # nothing was sent
    # what made the worker hang; should a libzmq release stop doing it, this says so
    assert wakes >= 1, "no empty POLLIN on a CURVE heartbeat (has libzmq changed?)"


def test_plain_text_client_cannot_reach_a_curve_server(keys):
    with server_factory(keys) as server_side, SocketFactory(options=OPTIONS) as plain_side:
        server = server_side.bind("intake", "tcp://127.0.0.1:*")
        push = plain_side.connect("intake", bound_endpoint(server))
        send_if_possible(push, heartbeat("plain"))
        assert server.poll(NOTHING_MS) == 0


def test_client_with_the_wrong_server_key_gets_nothing_through(keys):
    generate_keypair(keys / "elsewhere", "impostor")
    cfg = SecurityConfig(
        keys_dir=keys / "allowed", name="rollout-0", server_key=keys / "elsewhere/impostor.key"
    )
    with server_factory(keys) as server_side, SocketFactory(cfg, OPTIONS) as client_side:
        server = server_side.bind("intake", "tcp://127.0.0.1:*")
        push = client_side.connect("intake", bound_endpoint(server))
        send_if_possible(push, heartbeat("confused"))
        assert server.poll(NOTHING_MS) == 0


def test_key_added_to_the_allow_list_is_admitted_without_restart(keys, monkeypatch):
    from omnirl.protocol.auth import AllowListAuthenticator

    monkeypatch.setattr(AllowListAuthenticator, "RELOAD_INTERVAL_S", 0.0)
    with (
        server_factory(keys) as server_side,
        client_factory(keys, "intruder", "rollout-9") as late_side,
    ):
        server = server_side.bind("intake", "tcp://127.0.0.1:*")
        shutil.copy(keys / "intruder/rollout-9.key", keys / "allowed/rollout-9.key")
        push = late_side.connect("intake", bound_endpoint(server))
        send_message(push, heartbeat("late-joiner"))
        assert recv_message(server, timeout_ms=TIMEOUT_MS).unwrap().worker_id == "late-joiner"


def test_key_removed_from_the_allow_list_is_denied_without_restart(keys):
    """Revocation: the directory changed, so the next handshake reads it again (a
    connection already up is not cut by CURVE: the next test's per-message check)."""
    with server_factory(keys) as server_side:
        server = server_side.bind("intake", "tcp://127.0.0.1:*")
        with client_factory(keys, "allowed", "rollout-0") as before:
            push = before.connect("intake", bound_endpoint(server))
            send_message(push, heartbeat("before"))
            assert recv_message(server, timeout_ms=TIMEOUT_MS).unwrap().worker_id == "before"
        secret = keys / "allowed/rollout-0.key_secret"
        shutil.move(keys / "allowed/rollout-0.key", keys / "rollout-0.key")  # revoked
        shutil.move(secret, keys / "rollout-0.key_secret")
        with SocketFactory(
            SecurityConfig(
                keys_dir=keys, name="rollout-0", server_key=keys / "allowed/trainer.key"
            ),
            OPTIONS,
        ) as after:
            push = after.connect("intake", bound_endpoint(server))
            send_if_possible(push, heartbeat("after"))
            assert server.poll(NOTHING_MS) == 0, "a revoked key got a message through"
        assert server_side.authenticator.denied >= 1


def test_a_connection_made_before_its_key_was_revoked_is_named_as_revoked(keys, monkeypatch):
    """CURVE let the connection in at its handshake and keeps it up; each message still
    carries the key it came with, so the binding side knows, message by message, that the
    key is no longer allowed (and drops it: the trainer's and the reward worker's loops)."""
    from omnirl.protocol.auth import AllowListAuthenticator
    from omnirl.protocol.sockets import message_user_id

    monkeypatch.setattr(AllowListAuthenticator, "RELOAD_INTERVAL_S", 0.0)
    client_key = (keys / "allowed/rollout-0.key").read_text()
    with (
        server_factory(keys) as server_side,
        client_factory(keys, "allowed", "rollout-0") as client_side,
    ):
        server = server_side.bind("control", "tcp://127.0.0.1:*")
        dealer = client_side.connect("control", bound_endpoint(server))
        send_message(dealer, heartbeat("before"))
        assert server.poll(TIMEOUT_MS)
        frames = recv_ready(server)
        assert message_user_id(frames[-1]) in client_key  # the z85 key of its handshake
        assert server_side.revoked_sender(frames) is None
        shutil.move(keys / "allowed/rollout-0.key", keys / "rollout-0.key")  # revoked
        send_message(dealer, heartbeat("after"))  # the same live connection
        assert server.poll(TIMEOUT_MS), "the connection stays up at the transport level"
        frames = recv_ready(server)
        assert server_side.revoked_sender(frames) == message_user_id(frames[-1])
        shutil.move(keys / "rollout-0.key", keys / "allowed/rollout-0.key")  # granted again
        send_message(dealer, heartbeat("again"))
        assert server.poll(TIMEOUT_MS)
        assert server_side.revoked_sender(recv_ready(server)) is None


def test_without_curve_no_sender_is_revoked():
    with SocketFactory(options=OPTIONS) as sockets:
        pull = sockets.bind("intake", "tcp://127.0.0.1:*")
        push = sockets.connect("intake", bound_endpoint(pull))
        send_message(push, heartbeat("clear"))
        assert pull.poll(TIMEOUT_MS)
        assert sockets.revoked_sender(recv_ready(pull)) is None


def test_non_loopback_bind_without_keys_is_refused_and_insecure_allows_it():
    with SocketFactory(options=OPTIONS) as sockets:
        with pytest.raises(InsecureEndpointError, match="--insecure"):
            sockets.bind("control", "tcp://0.0.0.0:0")
        with pytest.raises(InsecureEndpointError):
            sockets.connect("intake", "tcp://192.0.2.7:5555")
        assert sockets.bind("control", "tcp://127.0.0.1:0")  # loopback needs no keys

    addresses = ["tcp://0.0.0.0:0"]
    ip = non_loopback_ip()
    if ip is not None:
        addresses.append(f"tcp://{ip}:0")
    with SocketFactory(SecurityConfig(insecure=True), OPTIONS) as sockets:
        for address in addresses:
            server = sockets.bind("intake", address)
            port = bound_endpoint(server).rsplit(":", 1)[1]
            host = "127.0.0.1" if address.startswith("tcp://0.0.0.0") else ip
            push = sockets.connect("intake", f"tcp://{host}:{port}")
            send_message(push, heartbeat(address))
            assert recv_message(server, timeout_ms=TIMEOUT_MS).unwrap().worker_id == address


def test_non_loopback_bind_with_keys_is_curve(keys):
    ip = non_loopback_ip() or "0.0.0.0"
    with (
        server_factory(keys) as server_side,
        client_factory(keys, "allowed", "rollout-0") as client_side,
    ):
        server = server_side.bind("intake", f"tcp://{ip}:0")
        assert server.getsockopt(zmq.CURVE_SERVER) == 1
        port = bound_endpoint(server).rsplit(":", 1)[1]
        host = "127.0.0.1" if ip == "0.0.0.0" else ip
        push = client_side.connect("intake", f"tcp://{host}:{port}")
        send_message(push, heartbeat("over-curve"))
        assert recv_message(server, timeout_ms=TIMEOUT_MS).unwrap().worker_id == "over-curve"


def test_curve_client_without_a_server_key_is_a_clear_error(keys):
    cfg = SecurityConfig(keys_dir=keys / "allowed", name="rollout-0")
    with SocketFactory(cfg, OPTIONS) as sockets, pytest.raises(ValueError, match="--server-key"):
        sockets.connect("control", "tcp://127.0.0.1:5555")


def test_missing_keys_are_a_clear_error(tmp_path):
    cfg = SecurityConfig(keys_dir=tmp_path / "nowhere", name="trainer")
    with SocketFactory(cfg, OPTIONS) as sockets:
        with pytest.raises(ValueError, match="cannot read key pair"):
            sockets.bind("control", "tcp://127.0.0.1:*")
        assert sockets.authenticator is None
