"""TrainerLink: a fixed trainer address, or the trainer's address file followed as it changes."""

from __future__ import annotations

import logging
import time

import pytest
import zmq

from omnirl.protocol.auth import SecurityConfig
from omnirl.protocol.sockets import SocketFactory, SocketOptions
from omnirl.protocol.trainer_link import (
    LINK_BACK,
    LINK_GONE,
    LINK_LOST,
    LINK_MOVED,
    TrainerLink,
    read_address_file,
)

A, B = "tcp://127.0.0.1:5991", "tcp://127.0.0.1:5992"
pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def sockets():
    with SocketFactory(SecurityConfig(), SocketOptions(linger_ms=0)) as factory:
        yield factory


def connected_to(link: TrainerLink) -> str:
    return link.control.getsockopt_string(zmq.LAST_ENDPOINT)


def test_the_address_file_is_followed_when_it_names_another_trainer(sockets, tmp_path):
    path = tmp_path / "trainer.addr"
    path.write_text(A + "\n")
    poller = zmq.Poller()
    link = TrainerLink(sockets, poller, address_file=path, reread_s=1.0)
    assert link.open(wait_s=1, stopped=lambda: False) and connected_to(link) == A
    first = link.control
    assert not link.follow(10.0)  # the same address: stay
    path.write_text(B + "\n")
    assert not link.follow(10.5)  # read at most every reread_s
    assert link.follow(11.0) and connected_to(link) == B and link.address == B
    assert first.closed and {s for s, _ in poller.sockets} == {link.control, link.monitor}
    path.unlink()  # a trainer starting again removes it first: stay where we are
    assert not link.follow(20.0) and link.address == B
    path.write_text("")
    assert not link.follow(30.0)
    link.close()
    assert not poller.sockets


def test_a_fixed_address_never_moves(sockets):
    link = TrainerLink(sockets, zmq.Poller(), address=A)
    assert link.open(wait_s=0, stopped=lambda: False) and connected_to(link) == A
    assert not link.follow(100.0)
    assert link.source == A
    link.close()  # its monitor socket too, else the context cannot terminate


def test_waiting_for_an_address_file_that_never_comes(sockets, tmp_path, caplog):
    link = TrainerLink(sockets, zmq.Poller(), address_file=tmp_path / "trainer.addr")
    with caplog.at_level(logging.ERROR, logger="omnirl.protocol.trainer_link"):
        assert not link.open(wait_s=0.3, stopped=lambda: False)
    assert "no trainer address in" in caplog.text and link.control is None
    caplog.clear()
    assert not link.open(wait_s=30, stopped=lambda: True)  # a stop request ends the wait
    assert not caplog.text


def test_a_file_that_is_not_an_address_file_is_a_clear_error(sockets, tmp_path, caplog):
    path = tmp_path / "trainer.addr"
    path.write_text('{"weights": "tcp://127.0.0.1:9"}')
    link = TrainerLink(sockets, zmq.Poller(), address_file=path)
    with caplog.at_level(logging.ERROR, logger="omnirl.protocol.trainer_link"):
        assert not link.open(wait_s=30, stopped=lambda: False)  # at once, not after 30 s
    assert "not a trainer address file" in caplog.text


def test_address_and_file_are_exclusive(sockets, tmp_path):
    with pytest.raises(ValueError, match="exactly one"):
        TrainerLink(sockets, zmq.Poller(), address=A, address_file=tmp_path / "f")
    with pytest.raises(ValueError, match="exactly one"):
        TrainerLink(sockets, zmq.Poller())


def test_address_file_formats_parse(tmp_path):
    path = tmp_path / "trainer.addr"
    path.write_text('{"control": "tcp://127.0.0.1:7"}')
    assert read_address_file(path) == "tcp://127.0.0.1:7"
    path.write_text("tcp://127.0.0.1:8\n")
    assert read_address_file(path) == "tcp://127.0.0.1:8"
    path.write_text("")  # being rewritten
    assert read_address_file(path) == ""
    assert read_address_file(tmp_path / "missing.addr") == ""
    path.write_text('{"weights": "tcp://127.0.0.1:9"}')
    with pytest.raises(ValueError, match="not a trainer address file"):
        read_address_file(path)


def _next_event(link: TrainerLink, poller: zmq.Poller, timeout_s: float = 10.0):
    """The next monitor event that means something to the clock (None: only others came)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if dict(poller.poll(100)).get(link.monitor):
            event = link.read_monitor()
            if event is not None:
                return event
    return None


def test_the_trainer_lost_clock_runs_while_down_or_unwelcomed(sockets):
    """A real trainer socket that goes away and comes back on the same port: the clock runs
    from the drop, stops when the connection is back, and runs again until the worker is
    welcomed; connected and welcomed it reads None."""
    ctx = zmq.Context.instance()
    trainer = ctx.socket(zmq.ROUTER)
    port = trainer.bind_to_random_port("tcp://127.0.0.1")
    address = f"tcp://127.0.0.1:{port}"
    poller = zmq.Poller()
    link = TrainerLink(sockets, poller, address=address)
    try:
        start = time.monotonic()
        link.open(wait_s=1, stopped=lambda: False)
        assert link.away(start + 3, welcomed=False) == pytest.approx(3, abs=0.5)  # no Welcome yet
        assert link.away(start + 3, welcomed=True) is None
        # the connection is up (a message got through) before the trainer goes: a socket
        # closed before the connect completes leaves no disconnect to see
        link.control.send(b"hello")
        assert trainer.poll(10_000) and trainer.recv_multipart()[-1] == b"hello"
        trainer.close(linger=0)
        assert _next_event(link, poller) == LINK_LOST
        dropped = time.monotonic()
        away = link.away(dropped + 2, welcomed=True)  # welcomed or not: the link is down
        assert away == pytest.approx(2, abs=0.5)
        link.unwelcome()  # forgetting the Welcome meanwhile does not restart the clock
        assert link.away(dropped + 2, welcomed=False) == pytest.approx(away, abs=1e-6)
        trainer = ctx.socket(zmq.ROUTER)
        trainer.bind(address)
        assert _next_event(link, poller) == LINK_BACK
        back = time.monotonic()
        assert link.away(back + 1, welcomed=False) == pytest.approx(1, abs=0.5)  # register again
        assert link.away(back + 1, welcomed=True) is None
    finally:
        link.close()
        trainer.close(linger=0)


def test_check_says_when_to_exit_and_when_the_link_moved(sockets, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="omnirl.protocol.trainer_link")
    path = tmp_path / "trainer.addr"
    path.write_text(A + "\n")
    link = TrainerLink(sockets, zmq.Poller(), address_file=path, reread_s=0.0)
    try:
        assert link.open(wait_s=1, stopped=lambda: False)
        t0 = time.monotonic()
        kw = dict(timeout_s=30.0, retry_s=5.0, name="w0")
        assert link.check(t0 + 100, welcomed=True, **kw) is None  # connected and welcomed
        assert link.check(t0 + 3, welcomed=False, **kw) is None  # within the retry interval
        assert link.check(t0 + 6, welcomed=False, **kw) is None  # the file names the same one
        path.write_text(B + "\n")
        assert link.check(t0 + 7, welcomed=False, **kw) == LINK_MOVED
        assert connected_to(link) == B and "w0: following the trainer to " + B in caplog.text
        # the clock starts again at the move (t0 + 7): not gone 20 s later, gone 31 s later
        assert link.check(t0 + 27, welcomed=False, **kw) is None
        assert link.check(t0 + 38, welcomed=False, **kw) == LINK_GONE
        assert "w0: trainer unreachable for 31 s, exiting" in caplog.text
    finally:
        link.close()


def test_tend_says_hello_until_welcomed_then_heartbeats(sockets):
    """A real ROUTER hears the schedule: Hello at once and every retry_s while unwelcomed,
    Heartbeats at the Welcome's interval after it, Hello at once again after unwelcome()."""
    from omnirl.protocol.messages import Heartbeat, Hello, Topology, Welcome
    from omnirl.protocol.sockets import bound_endpoint, recv_message

    router = sockets.bind("control", "tcp://127.0.0.1:*")
    link = TrainerLink(sockets, zmq.Poller(), address=bound_endpoint(router))
    assert link.open(wait_s=0, stopped=lambda: False)
    sent: list[str] = []

    def tick(now, welcome=None):
        state = link.tend(
            now,
            welcome=welcome,
            hello=lambda: Hello(role="rollout", worker_id="w"),
            heartbeat=lambda: Heartbeat(worker_id="w", role="rollout"),
            retry_s=2.0,
            timeout_s=1e9,
            name="w",
        )
        assert state is None  # the trainer is there: nothing to exit or follow

    def heard() -> list[str]:
        kinds = []
        while router.poll(300):
            kinds.append(type(recv_message(router).unwrap()).__name__)
        return kinds

    for now in (100.0, 101.0, 101.9, 102.0):  # Hello at once, then every 2 s
        tick(now)
    sent += heard()
    assert sent == ["Hello", "Hello"]
    where = Topology(control="c", intake="i", weights="w")
    welcome = Welcome(
        worker_id="w", run_id="r", topology=where, policy_version=0, heartbeat_interval_s=5.0
    )
    for now in (102.5, 103.0, 107.4, 107.5):  # a Heartbeat at once, then every 5 s
        tick(now, welcome)
    assert heard() == ["Heartbeat", "Heartbeat"]
    link.unwelcome(108.0)  # register again: no waiting for retry_s
    tick(108.0)
    tick(109.0)
    assert heard() == ["Hello"]
    link.close()
