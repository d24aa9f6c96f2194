"""Role-named ZeroMQ sockets and message send / receive over the codec.

Roles follow the conversation in ``docs/architecture.md``; the binding side of each role
gets the first socket type, the connecting side the second:

=========  ========  ===============  ==================================================
role       binds     connects         carries
=========  ========  ===============  ==================================================
control    ROUTER    DEALER           hello / welcome, leases, heartbeats, acks
weights    ROUTER    DEALER           weight requests, weight update chunks
intake     PULL      PUSH             scored trajectory groups into the trainer
reward     PULL      PUSH             trajectory groups into a reward worker
=========  ========  ===============  ==================================================

Every socket gets ``MAXMSGSIZE`` (libzmq disconnects a peer that sends a larger frame, so
an oversized message never reaches memory), a ``LINGER`` so that closing never hangs,
moderate high-water marks (a 64 MB group times the default HWM of 1000 is too much
memory), ZMTP heartbeats so that a dead tcp peer is noticed, and ``ROUTER_MANDATORY`` so
that sending to a vanished peer raises ``zmq.ZMQError(EHOSTUNREACH)`` instead of
vanishing silently.

Send-buffer pitfall: :func:`send_message` sends with ``copy=False``, so ZeroMQ reads the
tensors' memory *after* the call returns, from its I/O thread. Do not write into a sent
tensor until the send has completed. Pass ``track=True`` to get a tracker that is done
when **every** frame has been released (pyzmq alone tracks only the last frame of a
multipart send, and copies frames under ``zmq.COPY_THRESHOLD`` = 64 KiB, whose trackers
are done at once); ``tracker.wait(timeout)`` blocks until it is safe.

Blocking sends: a connecting socket with no live peer has nowhere to queue once libzmq
has dropped the connection's pipe (which it does when a CURVE server denies the
handshake), so a blocking send waits forever. Use ``SocketOptions.send_timeout_ms``
(``zmq.Again`` on expiry) or ``flags=zmq.NOBLOCK`` where that matters.

Receives after a poll: a poll's ``POLLIN`` does not promise a message. On a CurveZMQ
socket libzmq 4.3.5 reports ``POLLIN`` once, at the connection's first ZMTP heartbeat,
with nothing to receive, and a blocking receive after it waits for the next real message,
which in a worker loop may never come (a reward worker stopped heartbeating that way).
Receive with :func:`recv_ready` (or ``zmq.NOBLOCK``), which returns ``None`` then.
"""

from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

from omnirl.protocol.auth import (
    AllowListAuthenticator,
    KeyPair,
    SecurityConfig,
    SecurityConfigError,
    load_public_key,
    make_curve_client,
    make_curve_server,
)
from omnirl.protocol.codec import DEFAULT_MAX_BYTES, decode, encode
from omnirl.protocol.errors import ProtocolError
from omnirl.protocol.messages import Message

log = logging.getLogger(__name__)

ROLES: dict[str, tuple[int, int]] = {
    "control": (zmq.ROUTER, zmq.DEALER),
    "weights": (zmq.ROUTER, zmq.DEALER),
    "intake": (zmq.PULL, zmq.PUSH),
    "reward": (zmq.PULL, zmq.PUSH),
}


@dataclass(frozen=True, slots=True, kw_only=True)
class SocketOptions:
    """Options applied to every socket a :class:`SocketFactory` makes.

    ``max_bytes`` is both the socket's ``MAXMSGSIZE`` (which libzmq applies to each
    frame) and the decoder's limit on a whole message.
    """

    max_bytes: int = DEFAULT_MAX_BYTES
    linger_ms: int = 1000
    hwm: int = 64  # messages queued per peer, each way
    heartbeat_ivl_ms: int = 2000
    heartbeat_timeout_ms: int = 10000
    router_mandatory: bool = True
    send_timeout_ms: int = -1  # -1: block while the peer's queue is full (backpressure)

    def apply(self, sock: zmq.Socket) -> None:
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_bytes)
        sock.setsockopt(zmq.LINGER, self.linger_ms)
        sock.setsockopt(zmq.SNDHWM, self.hwm)
        sock.setsockopt(zmq.RCVHWM, self.hwm)
        sock.setsockopt(zmq.HEARTBEAT_IVL, self.heartbeat_ivl_ms)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, self.heartbeat_timeout_ms)
        sock.setsockopt(zmq.SNDTIMEO, self.send_timeout_ms)
        if self.router_mandatory and sock.type == zmq.ROUTER:
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)


def bound_endpoint(sock: zmq.Socket) -> str:
    """The endpoint a socket really bound (``tcp://127.0.0.1:*`` becomes its port)."""
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


WILDCARD_HOSTS = frozenset({"0.0.0.0", "*", "", "::", "[::]"})


def advertised_endpoint(bound: str, advertise: str = "") -> str:
    """The address other hosts connect to for a socket bound at ``bound`` (a
    :func:`bound_endpoint`, port resolved): ``advertise`` (a host name or IP) in place of the
    bound host where given, else the machine's host name where the bind was to every
    interface (``tcp://0.0.0.0:5600`` means nothing to a peer), else ``bound`` unchanged.
    ``ipc://`` and ``inproc://`` endpoints are returned as they are."""
    if not bound.startswith("tcp://"):
        return bound
    host, _, port = bound.removeprefix("tcp://").rpartition(":")
    if advertise:
        host = advertise
    elif host in WILDCARD_HOSTS:
        host = socket.gethostname()
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 literal
    return f"tcp://{host}:{port}"


class SocketFactory:
    """Makes role-named sockets on one context under one :class:`SecurityConfig`.

    Owns the context's ZAP authenticator (started at the first CURVE bind) and every
    socket it made; :meth:`close` closes them all (use it as a context manager). A
    context has one ZAP handler, so give each CURVE factory its own context (the default).

    >>> with SocketFactory(SecurityConfig()) as sockets:
    ...     intake = sockets.bind("intake", "tcp://127.0.0.1:*")
    ...     push = sockets.connect("intake", bound_endpoint(intake))
    """

    def __init__(
        self,
        security: SecurityConfig | None = None,
        options: SocketOptions | None = None,
        *,
        context: zmq.Context | None = None,
    ):
        self.security = security or SecurityConfig()
        self.options = options or SocketOptions()
        self._own_context = context is None
        self.context = context or zmq.Context()
        self.authenticator: AllowListAuthenticator | None = None
        self._keys: KeyPair | None = None
        self._sockets: list[zmq.Socket] = []
        self._revoked_seen: set[str] = set()  # revoked keys already named in the log

    # ----------------------------------------------------------------------------- sockets

    def bind(self, role: str, address: str) -> zmq.Socket:
        """A socket of ``role``'s binding type, bound to ``address``.

        Raises :class:`~omnirl.protocol.auth.InsecureEndpointError` for a non-loopback
        address without keys (unless ``insecure``).
        """
        endpoint = self.security.check_endpoint(address)
        socket_type = socket_types(role)[0]
        if self.security.curve:
            keys = self._keypair()
            self._ensure_authenticator()
        sock = self._socket(socket_type, ipv6=endpoint.is_ipv6)
        if self.security.curve:
            make_curve_server(sock, keys)
        try:
            sock.bind(address)
        except zmq.ZMQError as e:
            self.discard(sock)
            raise zmq.ZMQError(e.errno, f"cannot bind {role} to {address}: {e.strerror}") from e
        return sock

    def connect(
        self, role: str, address: str, *, server_key: bytes | str | Path | None = None
    ) -> zmq.Socket:
        """A socket of ``role``'s connecting type, connected to ``address``.

        ``server_key``: the server's z85 public key (bytes) or its ``.key`` file; defaults
        to ``security.server_key``. Needed only with CURVE.
        """
        endpoint = self.security.check_endpoint(address)
        socket_type = socket_types(role)[1]
        if self.security.curve:
            keys, server_public = self._keypair(), self._server_public(server_key)
        sock = self._socket(socket_type, ipv6=endpoint.is_ipv6)
        if self.security.curve:
            make_curve_client(sock, keys, server_public)
        try:
            sock.connect(address)
        except zmq.ZMQError as e:
            self.discard(sock)
            raise zmq.ZMQError(e.errno, f"cannot connect {role} to {address}: {e.strerror}") from e
        return sock

    def revoked_sender(self, frames: list[zmq.Frame]) -> str | None:
        """The sender's key (z85) when the allow-list no longer holds it, else ``None``.

        ``frames``: a message received with ``copy=False`` on one of this factory's binding
        sockets. CURVE checks a key only at a connection's handshake; a binding process asks
        this of each message and drops those of a revoked key, so a connection that was up
        before the revocation gets nothing more through. Each revoked key is named in the
        log once. ``None`` without CURVE."""
        if self.authenticator is None or not frames:
            return None
        key = message_user_id(frames[-1])
        if key is None or self.authenticator.still_allowed(key):
            return None
        if key not in self._revoked_seen:
            self._revoked_seen.add(key)
            log.warning(
                "dropping messages from CURVE key %s: it is no longer in the allow-list "
                "(its connection was made before the key was removed)",
                key,
            )
        return key

    def close(self) -> None:
        for sock in self._sockets:
            sock.close()  # honours LINGER
        self._sockets.clear()
        if self.authenticator is not None:
            self.authenticator.stop()
            self.authenticator = None
        if self._own_context:
            self.context.term()

    def __enter__(self) -> SocketFactory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------------------- helpers

    def _socket(self, socket_type: int, *, ipv6: bool) -> zmq.Socket:
        sock = self.context.socket(socket_type)
        self.options.apply(sock)
        if ipv6:
            sock.setsockopt(zmq.IPV6, 1)
        self._sockets.append(sock)
        return sock

    def discard(self, sock: zmq.Socket) -> None:
        """Close one of this factory's sockets now (``LINGER`` 0) and forget it."""
        self._sockets.remove(sock)
        sock.close(linger=0)

    def _keypair(self) -> KeyPair:
        if self._keys is None:
            self._keys = self.security.keypair()
        return self._keys

    def _ensure_authenticator(self) -> None:
        if self.authenticator is None:
            auth = AllowListAuthenticator(self.context, self.security.allow_list_dir())
            auth.start()
            self.authenticator = auth

    def _server_public(self, server_key: bytes | str | Path | None) -> bytes:
        key = server_key if server_key is not None else self.security.server_key
        if key is None:
            raise SecurityConfigError(
                "CURVE client needs the server's public key (--server-key FILE)"
            )
        if isinstance(key, bytes):
            if len(key) != 40:
                raise SecurityConfigError("a z85 CURVE public key is 40 characters")
            return key
        return load_public_key(key)


def message_user_id(frame: zmq.Frame) -> str | None:
    """The ``User-Id`` ZeroMQ attached to a received frame (a CURVE client's z85 public key,
    set by the ZAP handler at the handshake); ``None`` on a connection without one."""
    try:
        return frame.get("User-Id") or None
    except (zmq.ZMQError, AttributeError):  # no ZAP on that connection; a copied frame
        return None


def socket_types(role: str) -> tuple[int, int]:
    """(binding type, connecting type) of a role."""
    try:
        return ROLES[role]
    except KeyError:
        raise ValueError(f"unknown socket role {role!r}; known: {sorted(ROLES)}") from None


# ------------------------------------------------------------------------------ messages


def send_frames(
    sock: zmq.Socket,
    frames: list[Any],
    *,
    identity: bytes | None = None,
    track: bool = False,
    flags: int = 0,
) -> zmq.MessageTracker | None:
    """Send already-encoded frames (e.g. a group forwarded untouched) with ``copy=False``.

    ``identity`` addresses a peer of a ROUTER socket. With ``track``, returns a tracker
    that is done when ZeroMQ has released every frame.
    """
    parts = [identity, *frames] if identity is not None else list(frames)
    if not track:
        sock.send_multipart(parts, flags=flags, copy=False)
        return None
    trackers = [sock.send(part, flags | zmq.SNDMORE, copy=False, track=True) for part in parts[:-1]]
    trackers.append(sock.send(parts[-1], flags, copy=False, track=True))
    return zmq.MessageTracker(*trackers)


def send_message(
    sock: zmq.Socket,
    msg: Message,
    *,
    identity: bytes | None = None,
    track: bool = False,
    flags: int = 0,
    check_finite: bool = True,
) -> zmq.MessageTracker | None:
    """Encode ``msg`` and send it; see :func:`send_frames` and the module's send pitfall.

    Raises :class:`~omnirl.protocol.errors.EncodeError` / ``NonFiniteValue`` for a message
    that cannot go on the wire (nothing is sent).
    """
    frames = encode(msg, check_finite=check_finite)
    return send_frames(sock, frames, identity=identity, track=track, flags=flags)


def send_nowait(sock: zmq.Socket, msg: Message) -> bool:
    """Send ``msg`` without blocking; False (logged at debug) when the peer is not taking
    messages (its queue is full while it is away): a worker drops, never stalls."""
    try:
        send_message(sock, msg, flags=zmq.NOBLOCK)
        return True
    except zmq.Again:
        log.debug("%s not sent: the peer is not taking messages", type(msg).__name__)
        return False


@dataclass(slots=True)
class Received:
    """One received multipart message: decoded, or refused with a typed error.

    ``frames`` are the message's frames after the identity (zmq.Frame objects, the
    decoded tensors' storage), kept for forwarding or recording without re-encoding.
    """

    identity: bytes | None
    message: Message | None
    error: ProtocolError | None
    nbytes: int
    frames: list[zmq.Frame] = field(default_factory=list, repr=False)

    @property
    def ok(self) -> bool:
        return self.error is None

    def unwrap(self) -> Message:
        """The message, or raise its :class:`~omnirl.protocol.errors.ProtocolError`."""
        if self.error is not None:
            raise self.error
        assert self.message is not None
        return self.message


def recv_message(
    sock: zmq.Socket,
    *,
    max_bytes: int | None = None,
    timeout_ms: int | None = None,
    check_finite: bool = True,
) -> Received:
    """Receive and decode one message (``copy=False``: tensors are views of the frames).

    ``max_bytes`` defaults to the socket's ``MAXMSGSIZE``. Bad input does not raise: it comes back as ``Received.error`` so that a server loop
    can log, count and carry on. Raises ``TimeoutError`` if nothing arrives within
    ``timeout_ms`` (``None``: wait forever).
    """
    if max_bytes is None:
        limit = sock.getsockopt(zmq.MAXMSGSIZE)
        max_bytes = limit if limit > 0 else DEFAULT_MAX_BYTES
    if timeout_ms is None:
        frames = sock.recv_multipart(copy=False)
    else:
        frames = _recv_within(sock, timeout_ms)
    identity = frames.pop(0).bytes if sock.type == zmq.ROUTER else None
    nbytes = sum(len(f) for f in frames)
    try:
        msg = decode(frames, max_bytes=max_bytes, check_finite=check_finite)
    except ProtocolError as e:
        return Received(identity, None, e, nbytes, frames)
    return Received(identity, msg, None, nbytes, frames)


def recv_ready(sock: zmq.Socket) -> list[zmq.Frame] | None:
    """The multipart message a poll said is waiting (``copy=False``), or ``None``.

    ``None`` when there is none after all: a poll's ``POLLIN`` on a CurveZMQ socket can
    come from a ZMTP heartbeat (see the module docstring), so never block after a poll.
    """
    try:
        return sock.recv_multipart(zmq.NOBLOCK, copy=False)
    except zmq.Again:
        return None


def _recv_within(sock: zmq.Socket, timeout_ms: int) -> list[zmq.Frame]:
    """The next multipart message within ``timeout_ms``; ``TimeoutError`` after it."""
    deadline = time.monotonic() + timeout_ms / 1000
    while True:
        left_ms = max(0, int((deadline - time.monotonic()) * 1000))
        if sock.poll(left_ms, zmq.POLLIN):
            frames = recv_ready(sock)
            if frames is not None:
                return frames
        if time.monotonic() >= deadline:
            raise TimeoutError(f"no message within {timeout_ms} ms")
