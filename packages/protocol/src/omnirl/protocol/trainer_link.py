"""A worker's control connection to the trainer, and where that trainer is.

The trainer's control address is either given (``--trainer tcp://HOST:PORT``) or read from
the address file the trainer writes, ``<run.output_dir>/trainer.addr``
(``--trainer-file PATH``). With a file the address is read again while the trainer is
unreachable, so that a trainer restarted somewhere else (a requeued Slurm job on another
node, a new port) is found: the worker connects there and registers again, without a
restart of its own. A fixed address relies on ZeroMQ's reconnection to the same place.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

import zmq
from zmq.utils.monitor import recv_monitor_message

from omnirl.protocol.messages import Message, Welcome
from omnirl.protocol.sockets import SocketFactory, send_nowait

log = logging.getLogger(__name__)

ADDRESS_FILE = "trainer.addr"  # in the run's output directory
LINK_LOST = "lost"  # TrainerLink.read_monitor: the control connection dropped
LINK_BACK = "back"  # ... and came back after a drop (register again)
LINK_GONE = "gone"  # TrainerLink.check: unreachable past the timeout (the worker exits)
LINK_MOVED = "moved"  # ... followed its address file elsewhere (register there)


def read_address_file(path: str | Path) -> str:
    """The control address in a trainer address file ("" while it is missing or empty).

    The file is a bare line (``tcp://HOST:PORT``) or JSON with a ``control`` key.
    """
    try:
        text = Path(path).read_text().strip()
    except FileNotFoundError:
        return ""
    if text.startswith("{"):
        try:
            return str(json.loads(text)["control"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}: not a trainer address file ({exc})") from None
    return text.splitlines()[0].strip() if text else ""


def add_trainer_arguments(parser: argparse.ArgumentParser) -> None:
    """``--trainer ADDRESS`` or ``--trainer-file PATH`` (one of them, required)."""
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--trainer", help="the trainer's control address, tcp://HOST:PORT")
    where.add_argument(
        "--trainer-file",
        help=f"the trainer's address file (<run.output_dir>/{ADDRESS_FILE}): waited for at "
        "start, read again while the trainer is unreachable, so that a trainer restarted "
        "elsewhere (another node, another port) is followed",
    )


class TrainerLink:
    """The control DEALER to the trainer, its connection monitor, their poller entries, and
    the worker's trainer-lost clock.

    ``address``: the trainer's fixed control address; or ``address_file``: a trainer
    address file, read again (at most every ``reread_s``) by :meth:`follow`.

    The clock (:meth:`away`) runs while the control connection is down (from the monitor's
    disconnect, :meth:`read_monitor`) or, connected, while the worker holds no Welcome
    (from its last :meth:`unwelcome`: a registration not yet answered, or forgotten). The
    worker exits when it passes its trainer timeout, and follows the address file once it
    passes its retry interval.
    """

    def __init__(
        self,
        sockets: SocketFactory,
        poller: zmq.Poller,
        *,
        address: str = "",
        address_file: str | Path | None = None,
        reread_s: float = 2.0,
    ):
        if bool(address) == (address_file is not None):
            raise ValueError("give exactly one of the trainer's address and its address file")
        self._sockets = sockets
        self._poller = poller
        self._file = Path(address_file) if address_file is not None else None
        self._reread_s = reread_s
        self._read_at = -1e9
        self.address = address
        self.control: zmq.Socket | None = None
        self.monitor: zmq.Socket | None = None
        self._lost_since: float | None = None
        self._unwelcomed_since = time.monotonic()
        self._hello_at = -1e9  # when the last Hello went out (-1e9: say it at once)
        self._next_beat = 0.0

    @property
    def source(self) -> str:
        """Where the address comes from, for logs."""
        return self.address if self._file is None else f"{self.address} (from {self._file})"

    def open(self, *, wait_s: float, stopped: Callable[[], bool]) -> bool:
        """Connect; with an address file, wait up to ``wait_s`` for it to name a trainer.

        False when the wait ran out or the file is not an address file (both logged as
        errors), or when ``stopped()`` became true first.
        """
        if self._file is not None:
            deadline = time.monotonic() + wait_s
            while not (address := self._read()):
                if address is None or stopped():
                    return False
                if time.monotonic() >= deadline:
                    log.error("no trainer address in %s after %.0f s", self._file, wait_s)
                    return False
                time.sleep(0.2)
            self.address = address
        self._connect()
        return True

    def follow(self, now: float) -> bool:
        """Read the address file again; connect anew if it names another trainer.

        True when the link moved (the caller registers again). Never moves without a file;
        reads it at most every ``reread_s``; a file that is missing, empty or unreadable
        (being rewritten) leaves the link where it is.
        """
        if self._file is None or now - self._read_at < self._reread_s:
            return False
        self._read_at = now
        address = self._read()
        if not address or address == self.address:
            return False
        log.info("the trainer's address file now names %s (was %s)", address, self.address)
        self._disconnect()
        self.address = address
        self._connect()
        self._lost_since = None
        self.unwelcome(now)  # the new trainer has not welcomed the worker yet
        return True

    def unwelcome(self, now: float | None = None) -> None:
        """The worker holds no Welcome from here on (it registers, or registers again): the
        clock counts from ``now`` unless the connection is down already, and the next
        :meth:`tend` says Hello at once."""
        self._unwelcomed_since = time.monotonic() if now is None else now
        self._hello_at = -1e9

    def away(self, now: float, *, welcomed: bool) -> float | None:
        """Seconds the trainer has been unreachable at ``now``: since the connection dropped,
        or, while ``welcomed`` is false, since the last :meth:`unwelcome`; None while the
        worker is connected and welcomed."""
        if self._lost_since is not None:
            return now - self._lost_since
        return None if welcomed else now - self._unwelcomed_since

    def check(
        self, now: float, *, welcomed: bool, timeout_s: float, retry_s: float, name: str
    ) -> str | None:
        """What the worker ``name`` must do about an unreachable trainer at ``now``:
        :data:`LINK_GONE` past ``timeout_s`` (exit), :data:`LINK_MOVED` when, past
        ``retry_s``, the address file named another trainer and the link moved there
        (register again), else None. Both are logged."""
        away = self.away(now, welcomed=welcomed)
        if away is None:
            return None
        if away > timeout_s:
            log.error("%s: trainer unreachable for %.0f s, exiting", name, away)
            return LINK_GONE
        if away > retry_s and self.follow(now):
            log.info("%s: following the trainer to %s", name, self.address)
            return LINK_MOVED
        return None

    def tend(
        self,
        now: float,
        *,
        welcome: Welcome | None,
        hello: Callable[[], Message],
        heartbeat: Callable[[], Message],
        retry_s: float,
        timeout_s: float,
        name: str,
    ) -> str | None:
        """One turn of a worker's loop on the link. First keep the registration: without a
        ``welcome``, send ``hello()`` every ``retry_s``; with one, ``heartbeat()`` every
        ``welcome.heartbeat_interval_s`` (never blocking: while the trainer is away its
        queue fills and the message is dropped). Then :meth:`check`'s answer: exit,
        register with the trainer the link moved to, or None."""
        if welcome is None:
            if now - self._hello_at >= retry_s:
                send_nowait(self.control, hello())
                self._hello_at = now
        elif now >= self._next_beat:
            send_nowait(self.control, heartbeat())
            self._next_beat = now + welcome.heartbeat_interval_s
        return self.check(
            now, welcomed=welcome is not None, timeout_s=timeout_s, retry_s=retry_s, name=name
        )

    def read_monitor(self, name: str = "worker") -> str | None:
        """Read one event off :attr:`monitor` (poll it first): :data:`LINK_LOST` when the
        connection dropped (the clock starts), :data:`LINK_BACK` when it is up again after a
        drop (the caller registers again: the clock goes on until a Welcome), None for the
        first connect and anything else. Both are logged under the worker's ``name``."""
        event = recv_monitor_message(self.monitor)["event"]
        if event == zmq.EVENT_DISCONNECTED:
            if self._lost_since is None:
                self._lost_since = time.monotonic()
            log.warning("%s: lost the trainer's control socket", name)
            return LINK_LOST
        if event == zmq.EVENT_CONNECTED and self._lost_since is not None:
            self._lost_since = None
            self.unwelcome()
            log.info("%s: trainer back, registering again", name)
            return LINK_BACK
        return None

    def close(self) -> None:
        self._disconnect()

    def _read(self) -> str | None:
        """The address in the file ("" while there is none); None if it cannot be one."""
        try:
            return read_address_file(self._file)
        except (OSError, ValueError) as exc:
            log.error("cannot read the trainer's address: %s", exc)
            return None

    def _connect(self) -> None:
        self.control = self._sockets.connect("control", self.address)
        self.monitor = self.control.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._poller.register(self.control, zmq.POLLIN)
        self._poller.register(self.monitor, zmq.POLLIN)

    def _disconnect(self) -> None:
        if self.control is None:
            return
        self._poller.unregister(self.control)
        self._poller.unregister(self.monitor)
        self.control.disable_monitor()
        self.monitor.close(linger=0)
        self._sockets.discard(self.control)
        self.control = self.monitor = None
