"""Socket helpers of the rollout worker: open with the security rule, send a message."""

from __future__ import annotations

import zmq
from omnirl.protocol.codec import encode

from omnirl.protocol.auth import SecurityConfig
from omnirl.protocol.messages import Message


def connect_socket(ctx: zmq.Context, kind: int, address: str, security: SecurityConfig):
    security.check_endpoint(address)
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


def bind_socket(ctx: zmq.Context, kind: int, address: str, security: SecurityConfig):
    security.check_endpoint(address)
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(address)
    return sock


def send(sock: zmq.Socket, msg: Message) -> None:
    sock.send_multipart(encode(msg), copy=False)
