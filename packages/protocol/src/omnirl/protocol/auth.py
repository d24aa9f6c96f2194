"""CurveZMQ key pairs, allow-lists, and the loopback / ``--insecure`` rule.

Key files use the ZeroMQ certificate format (the one ``zmq.auth`` reads): ``NAME.key``
holds the public key, ``NAME.key_secret`` the public and secret keys (file mode 0600).

The rule every socket follows (applied by :mod:`omnirl.protocol.sockets`):

- with keys configured (``SecurityConfig.keys_dir``), every socket uses CURVE: a binding
  socket is a CURVE server whose clients must be in the allow-list directory, a connecting
  socket is a CURVE client that must know the server's public key;
- without keys, loopback endpoints (127.0.0.0/8, ::1, ``localhost``, ``ipc://``,
  ``inproc://``) are allowed in the clear; any other endpoint raises
  :class:`InsecureEndpointError` unless ``insecure=True`` (the ``--insecure`` flag).

A client whose key is not in the allow-list never gets a message through: the
:class:`AllowListAuthenticator` denies its handshake, logs a warning naming the key, and
counts it. The allow-list directory is read again whenever its modification time changes
(a key file added, removed or renamed) and, at most once a second, when an unknown key
knocks, so keys are granted and revoked while a run goes on. CURVE authenticates a
connection once, at its handshake, so a revoked key's connections that are already up stay
up at the transport level; every message carries the key it came with (ZeroMQ's
``User-Id``), and a binding process drops the messages of a key the allow-list no longer
holds (:meth:`AllowListAuthenticator.still_allowed`,
:meth:`omnirl.protocol.sockets.SocketFactory.revoked_sender`): a revoked worker is cut off
within a second, and the trainer declares it lost as it would a dead one.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import zmq
from zmq.auth.certs import load_certificate
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

log = logging.getLogger(__name__)

PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"
ZAP_DOMAIN = "omnirl"
TRANSPORTS = ("tcp", "ipc", "inproc")


class SecurityConfigError(ValueError):
    """The security configuration cannot be honoured (missing or bad keys, bad endpoint)."""


class InsecureEndpointError(SecurityConfigError):
    """A non-loopback endpoint without CurveZMQ keys and without ``insecure=True``."""


class InvalidEndpointError(SecurityConfigError):
    """An endpoint string that is not ``tcp://HOST:PORT``, ``ipc://PATH`` or ``inproc://NAME``."""


# ---------------------------------------------------------------------------------- endpoints


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A parsed ZeroMQ endpoint. ``host``/``port`` are set for tcp, ``path`` otherwise."""

    transport: str
    host: str = ""
    port: str = ""  # "*" or "0": any free port (bind only)
    path: str = ""

    @property
    def is_ipv6(self) -> bool:
        return ":" in self.host

    @property
    def is_loopback(self) -> bool:
        if self.transport in ("ipc", "inproc"):
            return True
        if self.host.lower() in ("localhost", "localhost.localdomain", "ip6-localhost"):
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False  # "*", an interface name or a DNS name: treated as reachable


def parse_endpoint(address: str) -> Endpoint:
    """Parse ``tcp://HOST:PORT`` (IPv6 as ``[::1]``), ``ipc://PATH`` or ``inproc://NAME``."""
    transport, sep, rest = address.partition("://")
    if not sep or transport not in TRANSPORTS or not rest:
        raise InvalidEndpointError(
            f"endpoint {address!r}: expected tcp://HOST:PORT, ipc://PATH or inproc://NAME"
        )
    if transport != "tcp":
        return Endpoint(transport, path=rest)
    rest = rest.rpartition(";")[2]  # "tcp://source;destination": the destination matters
    if rest.startswith("["):
        host, close, tail = rest[1:].partition("]")
        port = tail[1:] if close and tail.startswith(":") else ""
    else:
        host, _, port = rest.rpartition(":")
    if not host or not (port == "*" or (port.isdigit() and int(port) <= 65535)):
        raise InvalidEndpointError(f"endpoint {address!r}: expected tcp://HOST:PORT")
    return Endpoint("tcp", host=host, port=port)


def is_loopback(address: str) -> bool:
    """True for endpoints only this machine can reach (loopback tcp, ipc, inproc)."""
    return parse_endpoint(address).is_loopback


# --------------------------------------------------------------------------------------- keys


@dataclass(frozen=True, slots=True)
class KeyPair:
    """A CURVE key pair, z85-encoded (40 ASCII bytes each)."""

    public: bytes
    secret: bytes


def _write_key_file(path: Path, public: bytes, secret: bytes | None, mode: int) -> None:
    kind = "Secret" if secret else "Public"
    lines = [
        f"#   ZeroMQ CURVE {kind} Certificate, written by omnirl keygen at "
        f"{datetime.now(UTC).isoformat(timespec='seconds')}",
        "metadata",
        "curve",
        f'    public-key = "{public.decode("ascii")}"',
    ]
    if secret:
        lines.append(f'    secret-key = "{secret.decode("ascii")}"')
    # O_EXCL + mode at creation: the secret is never readable by others, not even briefly.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write("\n".join(lines) + "\n")
    os.chmod(path, mode)  # the umask may have narrowed it; make it exact


def generate_keypair(directory: str | os.PathLike, name: str, *, overwrite: bool = False):
    """Write ``DIR/NAME.key`` (public, 0644) and ``DIR/NAME.key_secret`` (secret, 0600).

    Returns ``(public_path, secret_path)``. Refuses to replace existing files unless
    ``overwrite`` is set.
    """
    if not name or "/" in name or name.startswith("."):
        raise SecurityConfigError(f"key name {name!r}: expected a plain file name stem")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    public_path = directory / f"{name}{PUBLIC_SUFFIX}"
    secret_path = directory / f"{name}{SECRET_SUFFIX}"
    for path in (public_path, secret_path):
        if path.exists():
            if not overwrite:
                raise SecurityConfigError(f"{path} exists; not replacing it (--force replaces it)")
            path.unlink()
    public, secret = zmq.curve_keypair()
    _write_key_file(secret_path, public, secret, 0o600)
    _write_key_file(public_path, public, None, 0o644)
    return public_path, secret_path


def load_public_key(path: str | os.PathLike) -> bytes:
    """The z85 public key in a ``.key`` or ``.key_secret`` file."""
    try:
        public, _ = load_certificate(path)
    except (OSError, ValueError) as e:
        raise SecurityConfigError(f"cannot read public key from {path}: {e}") from e
    return public


def load_keypair(directory: str | os.PathLike, name: str) -> KeyPair:
    """Load ``DIR/NAME.key_secret``; refuses a secret file readable by group or others."""
    path = Path(directory) / f"{name}{SECRET_SUFFIX}"
    try:
        mode = path.stat().st_mode & 0o777
        public, secret = load_certificate(path)
    except (OSError, ValueError) as e:
        raise SecurityConfigError(f"cannot read key pair {path}: {e}") from e
    if mode & 0o077:
        raise SecurityConfigError(f"{path} has mode {mode:o}; a secret key must be 0600")
    if not secret:
        raise SecurityConfigError(f"{path} holds no secret key")
    return KeyPair(public=public, secret=secret)


# ----------------------------------------------------------------------------------- config


@dataclass(frozen=True, slots=True, kw_only=True)
class SecurityConfig:
    """How a process secures its sockets.

    ``keys_dir``/``name``: this process's key pair (``None``: no CURVE).
    ``allow_dir``: public keys (``*.key``) of clients a binding socket accepts; defaults
    to ``keys_dir``. ``server_key``: the public key file of the server a connecting socket
    talks to (``connect`` may override it per endpoint). ``insecure``: allow plain-text
    non-loopback endpoints.
    """

    keys_dir: Path | None = None
    name: str = ""
    allow_dir: Path | None = None
    server_key: Path | None = None
    insecure: bool = False

    @property
    def curve(self) -> bool:
        return self.keys_dir is not None

    def keypair(self) -> KeyPair:
        if self.keys_dir is None or not self.name:
            raise SecurityConfigError("CURVE needs keys_dir and a key name")
        return load_keypair(self.keys_dir, self.name)

    def allow_list_dir(self) -> Path:
        directory = self.allow_dir or self.keys_dir
        if directory is None or not Path(directory).is_dir():
            raise SecurityConfigError(f"allow-list directory {directory} does not exist")
        return Path(directory)

    def check_endpoint(self, address: str) -> Endpoint:
        """Parse ``address`` and apply the loopback / insecure rule."""
        endpoint = parse_endpoint(address)
        if not self.curve and not self.insecure and not endpoint.is_loopback:
            raise InsecureEndpointError(
                f"{address} is not a loopback endpoint and no CurveZMQ keys are configured: "
                "create keys with `omnirl keygen DIR --name NAME` and pass --keys DIR, "
                "or pass --insecure to send in the clear"
            )
        return endpoint

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> SecurityConfig:
        """Build from the flags of :func:`add_security_arguments`."""
        return cls(
            keys_dir=args.keys,
            name=args.key_name,
            allow_dir=args.allow_dir,
            server_key=args.server_key,
            insecure=args.insecure,
        )


def add_security_arguments(parser: argparse.ArgumentParser, *, default_name: str = "") -> None:
    """Add ``--keys --key-name --allow-dir --server-key --insecure`` to a process's CLI."""
    group = parser.add_argument_group("security (CurveZMQ)")
    group.add_argument("--keys", type=Path, default=None, help="folder of this process's key pair")
    group.add_argument("--key-name", default=default_name, help="key pair name in --keys")
    group.add_argument(
        "--allow-dir", type=Path, default=None, help="public keys of allowed peers (default --keys)"
    )
    group.add_argument(
        "--server-key", type=Path, default=None, help="public key file of the server we connect to"
    )
    group.add_argument(
        "--insecure",
        action="store_true",
        help="allow non-loopback endpoints without CurveZMQ (traffic in the clear)",
    )


# ----------------------------------------------------------------------------- authenticator


class AllowListAuthenticator(ThreadAuthenticator):
    """ZAP handler of one context: CURVE clients must be in ``allow_dir``.

    ``denied`` / ``allowed`` count handshakes; each denial is logged as a warning.
    """

    RELOAD_INTERVAL_S = 1.0

    def __init__(self, context: zmq.Context, allow_dir: str | os.PathLike):
        super().__init__(context, log=logging.getLogger(f"{__name__}.zap"))
        self.allow_dir = Path(allow_dir)
        self.allowed = 0
        self.denied = 0
        self._lock = threading.Lock()
        self._last_reload = 0.0
        self._last_check = 0.0
        self._dir_stamp: int | None = None

    def start(self) -> None:
        super().start()
        self.reload()

    def reload(self) -> None:
        """Re-read the allow-list directory."""
        self._last_reload = time.monotonic()
        self._dir_stamp = self._stamp()  # before the listing: a change during it shows later
        self.configure_curve(domain=ZAP_DOMAIN, location=str(self.allow_dir))

    def still_allowed(self, user_id: str) -> bool:
        """Whether the client key ``user_id`` (z85 text: what a message's ``User-Id`` holds
        after this handler let its connection in) is in the allow-list as it is now. The
        directory is read again when it changed (looked at most once a second), so a key
        removed from it stops being allowed within a second."""
        now = time.monotonic()
        if now - self._last_check >= self.RELOAD_INTERVAL_S:
            self._last_check = now
            if self._stamp() != self._dir_stamp:
                self.reload()
        return user_id.encode("ascii") in self.certs.get(ZAP_DOMAIN, {})

    def _stamp(self) -> int | None:
        try:
            return self.allow_dir.stat().st_mtime_ns
        except OSError:
            return None

    async def _authenticate_curve(self, domain: str, client_key: bytes) -> tuple[bool, bytes]:
        if self._stamp() != self._dir_stamp:
            self.reload()  # a key file added, removed or renamed since the last read
        ok, reason = await super()._authenticate_curve(domain, client_key)
        if not ok and time.monotonic() - self._last_reload >= self.RELOAD_INTERVAL_S:
            self.reload()  # a key added to the allow-list since the last read
            ok, reason = await super()._authenticate_curve(domain, client_key)
        with self._lock:
            if ok:
                self.allowed += 1
            else:
                self.denied += 1
        if not ok:
            log.warning(
                "CURVE handshake denied: client key %s is not in %s (%s)",
                z85.encode(client_key).decode("ascii"),
                self.allow_dir,
                reason.decode("ascii", "replace"),
            )
        return ok, reason


def make_curve_server(sock: zmq.Socket, keys: KeyPair) -> None:
    """Make ``sock`` a CURVE server (call before bind; a ZAP handler must be running)."""
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.zap_domain = ZAP_DOMAIN.encode()
    sock.curve_server = True


def make_curve_client(sock: zmq.Socket, keys: KeyPair, server_public: bytes) -> None:
    """Make ``sock`` a CURVE client of the server with public key ``server_public``."""
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_serverkey = server_public
