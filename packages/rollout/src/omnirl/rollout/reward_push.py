"""The rollout worker's way out: one PUSH socket connected to every reward worker it is told of.

ZeroMQ round-robins the groups among the connected reward workers. A group no reward worker
takes within ``send_timeout_s`` is dropped and counted; its lease then expires on the trainer
and is reissued, so nothing is lost.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import zmq

from omnirl.protocol.codec import encode
from omnirl.protocol.errors import ProtocolError
from omnirl.protocol.sockets import SocketFactory

log = logging.getLogger("omnirl.rollout")


class RewardPush:
    """Owned by the worker's loop thread, like every other socket it uses."""

    def __init__(self, sockets: SocketFactory, *, worker_id: str, send_timeout_s: float):
        self._sockets = sockets
        self._worker_id = worker_id
        self._send_timeout_s = send_timeout_s
        self._push: zmq.Socket | None = None
        self.addresses: set[str] = set()

    def connect(self, addresses: list[str]) -> None:
        """Connect to each address not yet connected (empty strings are skipped)."""
        for address in (a for a in addresses if a and a not in self.addresses):
            if self._push is None:
                self._push = self._sockets.connect("reward", address, server_key=self._key())
                self._push.setsockopt(zmq.SNDTIMEO, int(self._send_timeout_s * 1000))
            else:
                self._sockets.security.check_endpoint(address)
                self._push.connect(address)
            self.addresses.add(address)
            log.info("%s: sending groups to reward worker %s", self._worker_id, address)

    def send(self, group: Any, seconds: float) -> bool:
        """Send one sampled group, stamped with its sampling time; False when it was dropped."""
        group.timings = {**group.timings, "sample_s": seconds}
        try:
            frames = encode(group)
        except ProtocolError as exc:
            log.error("%s: group %s not sent: %s", self._worker_id, group.group_id, exc)
            return False
        try:
            self._push.send_multipart(frames, copy=False)
        except zmq.Again:
            log.error(
                "%s: no reward worker took group %s in %.0f s; dropped (the lease will "
                "be reissued)",
                self._worker_id,
                group.group_id,
                self._send_timeout_s,
            )
            return False
        return True

    def _key(self) -> Path | None:
        """With CURVE: reward workers' public key, ``<keys>/reward.key`` (one shared pair)."""
        keys = self._sockets.security.keys_dir
        if keys is None:
            return None
        path = keys / "reward.key"
        return path if path.is_file() else None
