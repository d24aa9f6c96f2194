"""Publishing policy versions to the rollout fleet on the trainer's ``weights`` ROUTER.

After each optimisation step the server calls :meth:`WeightPublisher.publish` with the
adapter's exported tensors (LoRA tensors when training LoRA, every weight otherwise). The
publisher copies them to fresh CPU tensors (a buffer still queued in ZeroMQ is never
written to again: the next version gets new tensors), splits them into checksummed
chunks (:func:`omnirl.protocol.weights.split_update`), encodes every chunk once and keeps
the encoded frames of the latest version, then

- pushes them to every peer that has asked for weights before (``peers``), and
- answers a :class:`~omnirl.protocol.messages.WeightRequest` from a late joiner with them,
  or with an ``Ack(detail="up_to_date")`` when the peer already holds the latest version.

Frames are sent with ``copy=False``: ZeroMQ references the tensors' memory, which the
publisher keeps alive (and unchanged) for as long as the version is the latest, and which
the frames themselves keep alive after that.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from omnirl.protocol.messages import Ack, WeightFormat, WeightRequest
from omnirl.protocol.weights import split_update

if TYPE_CHECKING:
    import torch
    import zmq

log = logging.getLogger(__name__)


def export_for_wire(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fresh, contiguous CPU copies that share no memory with the live parameters."""
    out = {}
    for name, t in tensors.items():
        out[name] = t.detach().to("cpu", copy=True).contiguous()
    return out


class WeightPublisher:
    def __init__(self, *, chunk_bytes: int, format: WeightFormat, adapter_config: dict | None):
        self.chunk_bytes = chunk_bytes
        self.format: WeightFormat = format
        self.adapter_config = dict(adapter_config or {})
        self.version = -1
        self.num_chunks = 0
        self.total_bytes = 0
        self.update_checksum = ""
        self._frames: list[list[Any]] = []  # encoded chunks of the latest version
        self.peers: dict[bytes, int] = {}  # routing id -> version last sent
        self.counters: dict[str, int] = {"versions": 0, "pushes": 0, "requests": 0}
        self.last_prepare_s = 0.0

    def prepare(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Make ``version`` the latest: copy, chunk, checksum and encode it once.

        Raises :class:`~omnirl.protocol.errors.NonFiniteValue` (naming the tensor) if a
        weight holds NaN or inf; the latest good version stays published.
        """
        from omnirl.protocol.codec import encode
        from omnirl.protocol.tensors import check_tensor_finite

        t0 = time.perf_counter()
        fresh = export_for_wire(tensors)
        # once here, not per receiver: WeightUpdate's chunks carry no finite-checked field
        for name, t in fresh.items():
            check_tensor_finite(t, field=f"weights[{name}]")
        chunks = split_update(
            version,
            self.format,
            fresh,
            chunk_bytes=self.chunk_bytes,
            adapter_config=self.adapter_config if self.format == "lora" else None,
        )
        self._frames = [encode(c) for c in chunks]
        self.version = version
        self.num_chunks = len(chunks)
        self.total_bytes = chunks[0].total_bytes
        self.update_checksum = chunks[0].update_checksum
        self.counters["versions"] += 1
        self.last_prepare_s = time.perf_counter() - t0

    def send_to(self, sock: zmq.Socket, peer: bytes) -> bool:
        """Queue every chunk of the latest version for ``peer``; False if it is gone."""
        import zmq

        try:
            for frames in self._frames:
                sock.send_multipart([peer, *frames], flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as err:  # EHOSTUNREACH under ROUTER_MANDATORY: peer vanished
            log.info("weights: peer %s unreachable (%s); forgotten", peer.hex(), err)
            self.forget(peer)
            return False
        self.peers[peer] = self.version
        self.counters["pushes"] += 1
        return True

    def broadcast(self, sock: zmq.Socket) -> int:
        """Push the latest version to every known peer that lacks it; returns how many."""
        n = 0
        for peer, have in list(self.peers.items()):
            if have < self.version and self.send_to(sock, peer):
                n += 1
        return n

    def publish(self, sock: zmq.Socket, version: int, tensors: dict[str, torch.Tensor]) -> int:
        self.prepare(version, tensors)
        return self.broadcast(sock)

    def handle_request(self, sock: zmq.Socket, peer: bytes, req: WeightRequest) -> None:
        """Answer a WeightRequest; also registers ``peer`` for future pushes."""
        import zmq

        from omnirl.protocol.codec import encode

        self.counters["requests"] += 1
        if self.version < 0 or req.have_version >= self.version:
            self.peers[peer] = max(req.have_version, self.peers.get(peer, -1))
            ack = Ack(ref=str(self.version), detail="up_to_date")
            try:
                sock.send_multipart([peer, *encode(ack)], flags=zmq.NOBLOCK, copy=False)
            except zmq.ZMQError:
                self.forget(peer)
            return
        self.send_to(sock, peer)

    def forget(self, peer: bytes) -> None:
        self.peers.pop(peer, None)
