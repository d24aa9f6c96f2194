"""The addresses a trainer bound to every interface sends its workers (Welcome, trainer.addr):
``runtime.advertise_host`` where set (a cluster's Service name or IP), else the host name;
never 0.0.0.0, which a worker on another machine cannot connect to."""

from __future__ import annotations

import socket

import zmq

from omnirl.protocol.messages import Ack
from omnirl.protocol.sockets import send_message

WILDCARD = ("runtime.host=0.0.0.0", "runtime.insecure=true", "runtime.control_port=0")


def test_a_wildcard_bind_advertises_the_given_host_and_it_is_reachable(null_server, no_model):
    server = null_server(no_model, *WILDCARD, "runtime.advertise_host=127.0.0.1")
    server._open()
    ctx = zmq.Context()
    try:
        assert set(server.addresses) == {"control", "weights", "intake"}
        for address in server.addresses.values():
            assert address.startswith("tcp://127.0.0.1:"), address
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(server.addresses["intake"])
        send_message(push, Ack(ref="hello"))
        assert server.intake_sock.poll(5000) and server.intake_sock.recv_multipart()
        push.close(0)
    finally:
        server.sockets.close()
        ctx.term()


def test_a_wildcard_bind_without_advertise_host_gives_the_host_name(null_server, no_model):
    server = null_server(no_model, *WILDCARD)
    server._open()
    try:
        host = socket.gethostname()
        for address in server.addresses.values():
            assert address.startswith(f"tcp://{host}:"), address
    finally:
        server.sockets.close()
