"""Helpers of the runtime tests: a stand-in trajectory group and a stand-in trainer end.

The stand-in trainer is the real thing on the wire (real sockets on loopback, the real
codec); it only does not train. It lets the worker loops be tested before, and apart
from, the trainer process.
"""

from __future__ import annotations

import time

import torch
import zmq

from omnirl.protocol.codec import decode, encode
from omnirl.protocol.messages import (
    DiffusionTrajectoryGroup,
    Message,
    PromptSpec,
    SamplingParams,
    Topology,
    Welcome,
)
from omnirl.protocol.sockets import SocketFactory, recv_ready


def make_group(group_id: str = "e0:0", g: int = 2, k: int = 2, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return DiffusionTrajectoryGroup(
        group_id=group_id,
        lease_id="lease-1",
        worker_id="rollout-x",
        prompt=PromptSpec(group_id=group_id, text="a red cube"),
        sampling=SamplingParams(group_size=g, num_steps=4, height=32, width=32),
        policy_version=3,
        seeds=torch.arange(g, dtype=torch.int64),
        timesteps=torch.linspace(1000, 500, k),
        latents=torch.randn(g, k, 4, 16, 16, generator=gen),  # 16 KiB: > zmq copy threshold? no
        next_latents=torch.randn(g, k, 4, 64, 64, generator=gen),  # 256 KiB
        log_probs=torch.randn(g, k, generator=gen),
        prompt_embeds=torch.randn(7, 32, generator=gen),
        images=torch.randint(0, 256, (g, 32, 32, 3), dtype=torch.uint8, generator=gen),
    )


class FakeTrainer:
    """A bound control ROUTER and intake PULL on loopback.

    ``sockets``: bind through this factory (e.g. one with CurveZMQ keys) instead.
    """

    def __init__(self, ctx: zmq.Context | None = None, *, sockets: SocketFactory | None = None):
        self.sockets = sockets
        if sockets is not None:
            self.ctx = sockets.context
            self.control, self.intake, self.weights = (
                sockets.bind(role, "tcp://127.0.0.1:*") for role in ("control", "intake", "weights")
            )
        else:
            self.ctx = ctx or zmq.Context()
            self.control = self.ctx.socket(zmq.ROUTER)
            self.control.bind("tcp://127.0.0.1:*")
            self.intake = self.ctx.socket(zmq.PULL)
            self.intake.bind("tcp://127.0.0.1:*")
            self.weights = self.ctx.socket(zmq.ROUTER)
            self.weights.bind("tcp://127.0.0.1:*")
        for s in (self.control, self.intake, self.weights):
            s.setsockopt(zmq.LINGER, 0)

    def address(self, sock: zmq.Socket) -> str:
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def topology(self, reward: list[str] | None = None) -> Topology:
        return Topology(
            control=self.address(self.control),
            intake=self.address(self.intake),
            weights=self.address(self.weights),
            reward=reward or [],
        )

    def recv(self, sock: zmq.Socket, timeout_s: float = 20.0, *, kind=Message):
        """(identity or None, message) of the next message of type ``kind`` on ``sock``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not sock.poll(100):
                continue
            frames = recv_ready(sock)  # None: a CURVE heartbeat woke the poll
            if frames is None:
                continue
            identity = frames.pop(0).bytes if sock.type == zmq.ROUTER else None
            msg = decode(frames, check_finite=False)
            if isinstance(msg, kind):
                return identity, msg
        raise TimeoutError(f"no {kind.__name__} within {timeout_s} s")

    def send(self, sock: zmq.Socket, identity: bytes | None, msg: Message) -> None:
        parts = ([identity] if identity is not None else []) + encode(msg)
        sock.send_multipart(parts, copy=False)

    def welcome(self, identity: bytes, worker_id: str, **kw) -> None:
        msg = Welcome(
            worker_id=worker_id,
            run_id="test",
            topology=self.topology(kw.pop("reward", None)),
            policy_version=kw.pop("policy_version", 0),
            heartbeat_interval_s=kw.pop("heartbeat_interval_s", 0.2),
            **kw,
        )
        self.send(self.control, identity, msg)

    def close(self) -> None:
        for s in (self.control, self.intake, self.weights):
            s.close(linger=0)
        if self.sockets is not None:
            self.sockets.close()
        else:
            self.ctx.term()
